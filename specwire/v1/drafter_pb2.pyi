from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]

class ProbsKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROBS_KIND_UNSPECIFIED: _ClassVar[ProbsKind]
    PROBS_KIND_NONE: _ClassVar[ProbsKind]
    PROBS_KIND_DENSE: _ClassVar[ProbsKind]
    PROBS_KIND_SPARSE: _ClassVar[ProbsKind]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
PROBS_KIND_UNSPECIFIED: ProbsKind
PROBS_KIND_NONE: ProbsKind
PROBS_KIND_DENSE: ProbsKind
PROBS_KIND_SPARSE: ProbsKind

class Tensor(_message.Message):
    __slots__ = ("data", "dtype", "shape")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, data: _Optional[bytes] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("protocol_version", "vocab_size", "hidden_size", "tokenizer_fingerprint", "feature_dim", "num_layers")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    vocab_size: int
    hidden_size: int
    tokenizer_fingerprint: str
    feature_dim: int
    num_layers: int
    def __init__(self, protocol_version: _Optional[int] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., feature_dim: _Optional[int] = ..., num_layers: _Optional[int] = ...) -> None: ...

class DrafterInfo(_message.Message):
    __slots__ = ("head", "feature_dim", "aux_layers", "max_num_drafts", "max_requests", "feature_dtype", "max_branches", "chains", "max_message_bytes", "shared_features_host", "shared_features_gpus", "queues_drafts", "returns_drafts_on_device")
    HEAD_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DIM_FIELD_NUMBER: _ClassVar[int]
    AUX_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    CHAINS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_FEATURES_HOST_FIELD_NUMBER: _ClassVar[int]
    SHARED_FEATURES_GPUS_FIELD_NUMBER: _ClassVar[int]
    QUEUES_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    RETURNS_DRAFTS_ON_DEVICE_FIELD_NUMBER: _ClassVar[int]
    head: str
    feature_dim: int
    aux_layers: _containers.RepeatedScalarFieldContainer[int]
    max_num_drafts: int
    max_requests: int
    feature_dtype: DType
    max_branches: int
    chains: bool
    max_message_bytes: int
    shared_features_host: str
    shared_features_gpus: _containers.RepeatedScalarFieldContainer[str]
    queues_drafts: bool
    returns_drafts_on_device: bool
    def __init__(self, head: _Optional[str] = ..., feature_dim: _Optional[int] = ..., aux_layers: _Optional[_Iterable[int]] = ..., max_num_drafts: _Optional[int] = ..., max_requests: _Optional[int] = ..., feature_dtype: _Optional[_Union[DType, str]] = ..., max_branches: _Optional[int] = ..., chains: _Optional[bool] = ..., max_message_bytes: _Optional[int] = ..., shared_features_host: _Optional[str] = ..., shared_features_gpus: _Optional[_Iterable[str]] = ..., queues_drafts: _Optional[bool] = ..., returns_drafts_on_device: _Optional[bool] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("ok", "message", "drafter", "protocol_version")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    drafter: DrafterInfo
    protocol_version: int
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ..., drafter: _Optional[_Union[DrafterInfo, _Mapping]] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("token_ids", "features", "shared_row")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    SHARED_ROW_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    features: Tensor
    shared_row: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[Tensor, _Mapping]] = ..., shared_row: _Optional[int] = ...) -> None: ...

class Accepted(_message.Message):
    __slots__ = ("position", "token_ids", "features", "shared_row")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    SHARED_ROW_FIELD_NUMBER: _ClassVar[int]
    position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    features: Tensor
    shared_row: int
    def __init__(self, position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[Tensor, _Mapping]] = ..., shared_row: _Optional[int] = ...) -> None: ...

class Free(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RequestUpdate(_message.Message):
    __slots__ = ("request_id", "new_request", "accepted", "free")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUEST_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_request: NewRequest
    accepted: Accepted
    free: Free
    def __init__(self, request_id: _Optional[str] = ..., new_request: _Optional[_Union[NewRequest, _Mapping]] = ..., accepted: _Optional[_Union[Accepted, _Mapping]] = ..., free: _Optional[_Union[Free, _Mapping]] = ...) -> None: ...

class DraftWant(_message.Message):
    __slots__ = ("request_id", "num_drafts", "temperature", "top_k", "seed", "num_branches", "verifying_branch", "keep_chain", "verifying_chain")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    VERIFYING_BRANCH_FIELD_NUMBER: _ClassVar[int]
    KEEP_CHAIN_FIELD_NUMBER: _ClassVar[int]
    VERIFYING_CHAIN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_drafts: int
    temperature: float
    top_k: int
    seed: int
    num_branches: int
    verifying_branch: int
    keep_chain: bool
    verifying_chain: bool
    def __init__(self, request_id: _Optional[str] = ..., num_drafts: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., num_branches: _Optional[int] = ..., verifying_branch: _Optional[int] = ..., keep_chain: _Optional[bool] = ..., verifying_chain: _Optional[bool] = ...) -> None: ...

class DraftStep(_message.Message):
    __slots__ = ("step_id", "updates", "wants", "shared_features", "queued")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    WANTS_FIELD_NUMBER: _ClassVar[int]
    SHARED_FEATURES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    updates: _containers.RepeatedCompositeFieldContainer[RequestUpdate]
    wants: _containers.RepeatedCompositeFieldContainer[DraftWant]
    shared_features: SharedFeatures
    queued: QueuedDrafts
    def __init__(self, step_id: _Optional[int] = ..., updates: _Optional[_Iterable[_Union[RequestUpdate, _Mapping]]] = ..., wants: _Optional[_Iterable[_Union[DraftWant, _Mapping]]] = ..., shared_features: _Optional[_Union[SharedFeatures, _Mapping]] = ..., queued: _Optional[_Union[QueuedDrafts, _Mapping]] = ...) -> None: ...

class QueuedDrafts(_message.Message):
    __slots__ = ("wants", "rows", "feature_cells", "settled_shape", "settled_buffer", "settled_event", "settled_slot", "sequence", "drafts_buffer", "drafts_slot", "forced_hit_rate")
    WANTS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_CELLS_FIELD_NUMBER: _ClassVar[int]
    SETTLED_SHAPE_FIELD_NUMBER: _ClassVar[int]
    SETTLED_BUFFER_FIELD_NUMBER: _ClassVar[int]
    SETTLED_EVENT_FIELD_NUMBER: _ClassVar[int]
    SETTLED_SLOT_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_BUFFER_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_SLOT_FIELD_NUMBER: _ClassVar[int]
    FORCED_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    wants: _containers.RepeatedCompositeFieldContainer[DraftWant]
    rows: _containers.RepeatedScalarFieldContainer[int]
    feature_cells: _containers.RepeatedScalarFieldContainer[int]
    settled_shape: _containers.RepeatedScalarFieldContainer[int]
    settled_buffer: SharedFeatures
    settled_event: bytes
    settled_slot: str
    sequence: int
    drafts_buffer: SharedFeatures
    drafts_slot: str
    forced_hit_rate: float
    def __init__(self, wants: _Optional[_Iterable[_Union[DraftWant, _Mapping]]] = ..., rows: _Optional[_Iterable[int]] = ..., feature_cells: _Optional[_Iterable[int]] = ..., settled_shape: _Optional[_Iterable[int]] = ..., settled_buffer: _Optional[_Union[SharedFeatures, _Mapping]] = ..., settled_event: _Optional[bytes] = ..., settled_slot: _Optional[str] = ..., sequence: _Optional[int] = ..., drafts_buffer: _Optional[_Union[SharedFeatures, _Mapping]] = ..., drafts_slot: _Optional[str] = ..., forced_hit_rate: _Optional[float] = ...) -> None: ...

class SharedFeatures(_message.Message):
    __slots__ = ("device_uuid", "memory_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "shape", "dtype")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    memory_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    def __init__(self, device_uuid: _Optional[str] = ..., memory_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class SparseProbs(_message.Message):
    __slots__ = ("indices", "values")
    INDICES_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    indices: Tensor
    values: Tensor
    def __init__(self, indices: _Optional[_Union[Tensor, _Mapping]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Branch(_message.Message):
    __slots__ = ("index", "accepted", "bonus_token_id")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    index: int
    accepted: int
    bonus_token_id: int
    def __init__(self, index: _Optional[int] = ..., accepted: _Optional[int] = ..., bonus_token_id: _Optional[int] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("request_id", "draft_token_ids", "probs_kind", "probs", "sparse", "branch")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_KIND_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs_kind: ProbsKind
    probs: Tensor
    sparse: SparseProbs
    branch: Branch
    def __init__(self, request_id: _Optional[str] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., probs_kind: _Optional[_Union[ProbsKind, str]] = ..., probs: _Optional[_Union[Tensor, _Mapping]] = ..., sparse: _Optional[_Union[SparseProbs, _Mapping]] = ..., branch: _Optional[_Union[Branch, _Mapping]] = ...) -> None: ...

class DraftResult(_message.Message):
    __slots__ = ("step_id", "proposals", "error", "compute_seconds", "dropped_request_ids", "shared_features_error", "queued_hits", "tables_served", "queued_lookups")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    SHARED_FEATURES_ERROR_FIELD_NUMBER: _ClassVar[int]
    QUEUED_HITS_FIELD_NUMBER: _ClassVar[int]
    TABLES_SERVED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    proposals: _containers.RepeatedCompositeFieldContainer[Proposal]
    error: str
    compute_seconds: float
    dropped_request_ids: _containers.RepeatedScalarFieldContainer[str]
    shared_features_error: str
    queued_hits: int
    tables_served: bool
    queued_lookups: int
    def __init__(self, step_id: _Optional[int] = ..., proposals: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ..., error: _Optional[str] = ..., compute_seconds: _Optional[float] = ..., dropped_request_ids: _Optional[_Iterable[str]] = ..., shared_features_error: _Optional[str] = ..., queued_hits: _Optional[int] = ..., tables_served: _Optional[bool] = ..., queued_lookups: _Optional[int] = ...) -> None: ...
