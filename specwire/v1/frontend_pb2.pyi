from specwire.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CoreCall(_message.Message):
    __slots__ = ("submit", "abort", "model_info")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    MODEL_INFO_FIELD_NUMBER: _ClassVar[int]
    submit: _generation_pb2.GenerateRequest
    abort: CoreAbort
    model_info: int
    def __init__(self, submit: _Optional[_Union[_generation_pb2.GenerateRequest, _Mapping]] = ..., abort: _Optional[_Union[CoreAbort, _Mapping]] = ..., model_info: _Optional[int] = ...) -> None: ...

class CoreAbort(_message.Message):
    __slots__ = ("request_id", "cancelled")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    cancelled: bool
    def __init__(self, request_id: _Optional[str] = ..., cancelled: _Optional[bool] = ...) -> None: ...

class CoreEvents(_message.Message):
    __slots__ = ("responses", "model_info", "model_info_nonce", "tokenizer")
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    MODEL_INFO_FIELD_NUMBER: _ClassVar[int]
    MODEL_INFO_NONCE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[_generation_pb2.GenerateResponse]
    model_info: _generation_pb2.ModelInfo
    model_info_nonce: int
    tokenizer: str
    def __init__(self, responses: _Optional[_Iterable[_Union[_generation_pb2.GenerateResponse, _Mapping]]] = ..., model_info: _Optional[_Union[_generation_pb2.ModelInfo, _Mapping]] = ..., model_info_nonce: _Optional[int] = ..., tokenizer: _Optional[str] = ...) -> None: ...
