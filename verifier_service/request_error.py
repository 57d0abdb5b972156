"""A request refused or failed as its client sees it: an in-band Error with a google.rpc code, the RPC itself
ending OK. Free of torch, as the front-end process (frontend.py) refuses requests too."""

from __future__ import annotations

from specwire.v1 import generation_pb2 as pb


class RequestError(ValueError):
    """A request the verifier refuses; `code` is a generation_pb2.ErrorCode."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def in_flight_already(request_id: str) -> RequestError:
    return RequestError(pb.ERROR_CODE_ALREADY_EXISTS, f"request_id {request_id!r} is already in flight")


def error_response(request_id: str, e: RequestError) -> pb.GenerateResponse:
    """The stream's one message for a request refused or failed."""
    return pb.GenerateResponse(request_id=request_id, error=pb.Error(code=e.code, message=str(e)))
