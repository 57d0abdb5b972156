"""Rebuild a gRPC method handler around a new behaviour (server interceptors that wrap or refuse calls)."""

from collections.abc import Callable
from typing import Any

import grpc

_MAKERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def behavior_of(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    """The servicer callable behind `handler`, whatever its streaming kind."""
    return next(b for b in (handler.unary_unary, handler.unary_stream, handler.stream_unary,
                            handler.stream_stream) if b is not None)


def same_kind_handler(handler: grpc.RpcMethodHandler, behavior: Callable[..., Any],
                      request_deserializer: Callable[[bytes], Any] | None = None) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s streaming kind and serializers that runs `behavior` instead."""
    make = _MAKERS[(handler.request_streaming, handler.response_streaming)]
    return make(behavior, request_deserializer=request_deserializer or handler.request_deserializer,
                response_serializer=handler.response_serializer)
