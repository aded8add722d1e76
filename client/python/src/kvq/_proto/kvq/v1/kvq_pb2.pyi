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
    DTYPE_F32: _ClassVar[DType]
    DTYPE_F16: _ClassVar[DType]
    DTYPE_BF16: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
DTYPE_F32: DType
DTYPE_F16: DType
DTYPE_BF16: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class CodecSettings(_message.Message):
    __slots__ = ("key_bits", "key_group", "rank", "side_bits", "value_bits", "value_group", "value_policy", "value_budget", "sink_tokens", "window", "rotate_keys", "rotate_values", "metric_rounding", "fp16_sinks", "sparse_keys", "sparse_values")
    class ValuePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        VALUE_POLICY_DEFAULT: _ClassVar[CodecSettings.ValuePolicy]
        VALUE_POLICY_UNIFORM: _ClassVar[CodecSettings.ValuePolicy]
        VALUE_POLICY_A2: _ClassVar[CodecSettings.ValuePolicy]
    VALUE_POLICY_DEFAULT: CodecSettings.ValuePolicy
    VALUE_POLICY_UNIFORM: CodecSettings.ValuePolicy
    VALUE_POLICY_A2: CodecSettings.ValuePolicy
    KEY_BITS_FIELD_NUMBER: _ClassVar[int]
    KEY_GROUP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SIDE_BITS_FIELD_NUMBER: _ClassVar[int]
    VALUE_BITS_FIELD_NUMBER: _ClassVar[int]
    VALUE_GROUP_FIELD_NUMBER: _ClassVar[int]
    VALUE_POLICY_FIELD_NUMBER: _ClassVar[int]
    VALUE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    ROTATE_KEYS_FIELD_NUMBER: _ClassVar[int]
    ROTATE_VALUES_FIELD_NUMBER: _ClassVar[int]
    METRIC_ROUNDING_FIELD_NUMBER: _ClassVar[int]
    FP16_SINKS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_KEYS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_VALUES_FIELD_NUMBER: _ClassVar[int]
    key_bits: int
    key_group: int
    rank: int
    side_bits: int
    value_bits: int
    value_group: int
    value_policy: CodecSettings.ValuePolicy
    value_budget: float
    sink_tokens: int
    window: int
    rotate_keys: bool
    rotate_values: bool
    metric_rounding: bool
    fp16_sinks: int
    sparse_keys: int
    sparse_values: int
    def __init__(self, key_bits: _Optional[int] = ..., key_group: _Optional[int] = ..., rank: _Optional[int] = ..., side_bits: _Optional[int] = ..., value_bits: _Optional[int] = ..., value_group: _Optional[int] = ..., value_policy: _Optional[_Union[CodecSettings.ValuePolicy, str]] = ..., value_budget: _Optional[float] = ..., sink_tokens: _Optional[int] = ..., window: _Optional[int] = ..., rotate_keys: bool = ..., rotate_values: bool = ..., metric_rounding: bool = ..., fp16_sinks: _Optional[int] = ..., sparse_keys: _Optional[int] = ..., sparse_values: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "version", "layers", "kv_heads", "q_heads", "head_dim", "basis_rank", "has_basis", "fingerprint", "rope_layout", "channel_order", "kind", "codec", "live_sequences", "calibration_tokens", "oblique", "has_query_moment", "block_version_min", "block_version_max")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    Q_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BASIS_RANK_FIELD_NUMBER: _ClassVar[int]
    HAS_BASIS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ROPE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_ORDER_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    LIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OBLIQUE_FIELD_NUMBER: _ClassVar[int]
    HAS_QUERY_MOMENT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_VERSION_MIN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_VERSION_MAX_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    layers: int
    kv_heads: int
    q_heads: int
    head_dim: int
    basis_rank: int
    has_basis: bool
    fingerprint: str
    rope_layout: str
    channel_order: str
    kind: str
    codec: CodecSettings
    live_sequences: int
    calibration_tokens: int
    oblique: bool
    has_query_moment: bool
    block_version_min: int
    block_version_max: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., q_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., basis_rank: _Optional[int] = ..., has_basis: bool = ..., fingerprint: _Optional[str] = ..., rope_layout: _Optional[str] = ..., channel_order: _Optional[str] = ..., kind: _Optional[str] = ..., codec: _Optional[_Union[CodecSettings, _Mapping]] = ..., live_sequences: _Optional[int] = ..., calibration_tokens: _Optional[int] = ..., oblique: bool = ..., has_query_moment: bool = ..., block_version_min: _Optional[int] = ..., block_version_max: _Optional[int] = ...) -> None: ...

class EncodedGroups(_message.Message):
    __slots__ = ("blocks", "block_bytes", "sink_keys", "sink_values", "basis_fingerprint")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SINK_KEYS_FIELD_NUMBER: _ClassVar[int]
    SINK_VALUES_FIELD_NUMBER: _ClassVar[int]
    BASIS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    blocks: bytes
    block_bytes: _containers.RepeatedScalarFieldContainer[int]
    sink_keys: Tensor
    sink_values: Tensor
    basis_fingerprint: str
    def __init__(self, blocks: _Optional[bytes] = ..., block_bytes: _Optional[_Iterable[int]] = ..., sink_keys: _Optional[_Union[Tensor, _Mapping]] = ..., sink_values: _Optional[_Union[Tensor, _Mapping]] = ..., basis_fingerprint: _Optional[str] = ...) -> None: ...

class RegisterBasisRequest(_message.Message):
    __slots__ = ("info", "basis", "encode_basis", "query_moment")
    INFO_FIELD_NUMBER: _ClassVar[int]
    BASIS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_BASIS_FIELD_NUMBER: _ClassVar[int]
    QUERY_MOMENT_FIELD_NUMBER: _ClassVar[int]
    info: ModelInfo
    basis: _containers.RepeatedCompositeFieldContainer[Tensor]
    encode_basis: _containers.RepeatedCompositeFieldContainer[Tensor]
    query_moment: _containers.RepeatedCompositeFieldContainer[Tensor]
    def __init__(self, info: _Optional[_Union[ModelInfo, _Mapping]] = ..., basis: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., encode_basis: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., query_moment: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ...) -> None: ...

class RegisterBasisResponse(_message.Message):
    __slots__ = ("model", "already_registered")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ALREADY_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    model: ModelInfo
    already_registered: bool
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ..., already_registered: bool = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ("model", "version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class Append(_message.Message):
    __slots__ = ("sequence_id", "layer", "start", "keys", "values", "probe_weights", "model", "basis_version", "codec", "token_ids", "encoded")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    PROBE_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BASIS_VERSION_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ENCODED_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    layer: int
    start: int
    keys: Tensor
    values: Tensor
    probe_weights: Tensor
    model: str
    basis_version: int
    codec: CodecSettings
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    encoded: EncodedGroups
    def __init__(self, sequence_id: _Optional[str] = ..., layer: _Optional[int] = ..., start: _Optional[int] = ..., keys: _Optional[_Union[Tensor, _Mapping]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ..., probe_weights: _Optional[_Union[Tensor, _Mapping]] = ..., model: _Optional[str] = ..., basis_version: _Optional[int] = ..., codec: _Optional[_Union[CodecSettings, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., encoded: _Optional[_Union[EncodedGroups, _Mapping]] = ...) -> None: ...

class PutBlocksRequest(_message.Message):
    __slots__ = ("appends",)
    APPENDS_FIELD_NUMBER: _ClassVar[int]
    appends: _containers.RepeatedCompositeFieldContainer[Append]
    def __init__(self, appends: _Optional[_Iterable[_Union[Append, _Mapping]]] = ...) -> None: ...

class PutBlocksResponse(_message.Message):
    __slots__ = ("messages", "appends", "tokens_written", "tokens_duplicate", "tokens_shared", "lengths")
    class Length(_message.Message):
        __slots__ = ("sequence_id", "layer", "tokens")
        SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
        LAYER_FIELD_NUMBER: _ClassVar[int]
        TOKENS_FIELD_NUMBER: _ClassVar[int]
        sequence_id: str
        layer: int
        tokens: int
        def __init__(self, sequence_id: _Optional[str] = ..., layer: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    APPENDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    TOKENS_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SHARED_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    messages: int
    appends: int
    tokens_written: int
    tokens_duplicate: int
    tokens_shared: int
    lengths: _containers.RepeatedCompositeFieldContainer[PutBlocksResponse.Length]
    def __init__(self, messages: _Optional[int] = ..., appends: _Optional[int] = ..., tokens_written: _Optional[int] = ..., tokens_duplicate: _Optional[int] = ..., tokens_shared: _Optional[int] = ..., lengths: _Optional[_Iterable[_Union[PutBlocksResponse.Length, _Mapping]]] = ...) -> None: ...

class ItemStatus(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ScoreItem(_message.Message):
    __slots__ = ("sequence_id", "layer", "basis_version", "queries", "scale", "corrections_only", "append")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    BASIS_VERSION_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    CORRECTIONS_ONLY_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    layer: int
    basis_version: int
    queries: Tensor
    scale: float
    corrections_only: bool
    append: Append
    def __init__(self, sequence_id: _Optional[str] = ..., layer: _Optional[int] = ..., basis_version: _Optional[int] = ..., queries: _Optional[_Union[Tensor, _Mapping]] = ..., scale: _Optional[float] = ..., corrections_only: bool = ..., append: _Optional[_Union[Append, _Mapping]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ...) -> None: ...

class ScoreResult(_message.Message):
    __slots__ = ("status", "logits", "tokens")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    status: ItemStatus
    logits: Tensor
    tokens: int
    def __init__(self, status: _Optional[_Union[ItemStatus, _Mapping]] = ..., logits: _Optional[_Union[Tensor, _Mapping]] = ..., tokens: _Optional[int] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ScoreResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ScoreResult, _Mapping]]] = ...) -> None: ...

class ReadoutItem(_message.Message):
    __slots__ = ("sequence_id", "layer", "basis_version", "weights", "weights_are_logits", "output_dtype")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    BASIS_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ARE_LOGITS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    layer: int
    basis_version: int
    weights: Tensor
    weights_are_logits: bool
    output_dtype: DType
    def __init__(self, sequence_id: _Optional[str] = ..., layer: _Optional[int] = ..., basis_version: _Optional[int] = ..., weights: _Optional[_Union[Tensor, _Mapping]] = ..., weights_are_logits: bool = ..., output_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class ReadoutRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ReadoutItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ReadoutItem, _Mapping]]] = ...) -> None: ...

class ReadoutResult(_message.Message):
    __slots__ = ("status", "outputs", "tokens")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    status: ItemStatus
    outputs: Tensor
    tokens: int
    def __init__(self, status: _Optional[_Union[ItemStatus, _Mapping]] = ..., outputs: _Optional[_Union[Tensor, _Mapping]] = ..., tokens: _Optional[int] = ...) -> None: ...

class ReadoutResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ReadoutResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ReadoutResult, _Mapping]]] = ...) -> None: ...

class AttendItem(_message.Message):
    __slots__ = ("sequence_id", "layer", "basis_version", "queries", "causal_offset", "scale", "observe", "output_dtype", "append")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    BASIS_VERSION_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    CAUSAL_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    OBSERVE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    layer: int
    basis_version: int
    queries: Tensor
    causal_offset: int
    scale: float
    observe: bool
    output_dtype: DType
    append: Append
    def __init__(self, sequence_id: _Optional[str] = ..., layer: _Optional[int] = ..., basis_version: _Optional[int] = ..., queries: _Optional[_Union[Tensor, _Mapping]] = ..., causal_offset: _Optional[int] = ..., scale: _Optional[float] = ..., observe: bool = ..., output_dtype: _Optional[_Union[DType, str]] = ..., append: _Optional[_Union[Append, _Mapping]] = ...) -> None: ...

class AttendRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[AttendItem]
    def __init__(self, items: _Optional[_Iterable[_Union[AttendItem, _Mapping]]] = ...) -> None: ...

class AttendResult(_message.Message):
    __slots__ = ("status", "outputs", "tokens")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    status: ItemStatus
    outputs: Tensor
    tokens: int
    def __init__(self, status: _Optional[_Union[ItemStatus, _Mapping]] = ..., outputs: _Optional[_Union[Tensor, _Mapping]] = ..., tokens: _Optional[int] = ...) -> None: ...

class AttendResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[AttendResult]
    def __init__(self, results: _Optional[_Iterable[_Union[AttendResult, _Mapping]]] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("sequence_id", "layers", "basis_version", "dtype", "max_tokens_per_message", "from_token", "to_token", "codes", "max_block_version")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    BASIS_VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FROM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TO_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CODES_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_VERSION_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    basis_version: int
    dtype: DType
    max_tokens_per_message: int
    from_token: int
    to_token: int
    codes: bool
    max_block_version: int
    def __init__(self, sequence_id: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., basis_version: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., max_tokens_per_message: _Optional[int] = ..., from_token: _Optional[int] = ..., to_token: _Optional[int] = ..., codes: bool = ..., max_block_version: _Optional[int] = ...) -> None: ...

class GetBlocksResponse(_message.Message):
    __slots__ = ("layer", "start", "keys", "values", "layer_tokens", "basis_version", "encoded", "model", "codec")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    LAYER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BASIS_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENCODED_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    layer: int
    start: int
    keys: Tensor
    values: Tensor
    layer_tokens: int
    basis_version: int
    encoded: EncodedGroups
    model: str
    codec: CodecSettings
    def __init__(self, layer: _Optional[int] = ..., start: _Optional[int] = ..., keys: _Optional[_Union[Tensor, _Mapping]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ..., layer_tokens: _Optional[int] = ..., basis_version: _Optional[int] = ..., encoded: _Optional[_Union[EncodedGroups, _Mapping]] = ..., model: _Optional[str] = ..., codec: _Optional[_Union[CodecSettings, _Mapping]] = ...) -> None: ...

class MatchPrefixRequest(_message.Message):
    __slots__ = ("model", "basis_version", "codec", "token_ids", "sequence_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BASIS_VERSION_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    basis_version: int
    codec: CodecSettings
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sequence_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., basis_version: _Optional[int] = ..., codec: _Optional[_Union[CodecSettings, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., sequence_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class MatchPrefixResponse(_message.Message):
    __slots__ = ("indexed_tokens", "sequence_tokens")
    INDEXED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    indexed_tokens: int
    sequence_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, indexed_tokens: _Optional[int] = ..., sequence_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DeleteSequenceRequest(_message.Message):
    __slots__ = ("sequence_id",)
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    def __init__(self, sequence_id: _Optional[str] = ...) -> None: ...

class DeleteSequenceResponse(_message.Message):
    __slots__ = ("bytes_freed",)
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    bytes_freed: int
    def __init__(self, bytes_freed: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tenant", "sequences", "tokens", "stored_bytes", "quota_bytes", "evictions", "k_bits_per_element", "v_bits_per_element", "prefix_blocks", "prefix_bytes", "retained_prefix_bytes", "shared_tokens", "client_inflight", "client_inflight_limit", "server_inflight_limit", "server_stored_bytes", "server_capacity_bytes", "memory_pool", "compute_backend", "uptime_seconds")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    K_BITS_PER_ELEMENT_FIELD_NUMBER: _ClassVar[int]
    V_BITS_PER_ELEMENT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BYTES_FIELD_NUMBER: _ClassVar[int]
    RETAINED_PREFIX_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_INFLIGHT_LIMIT_FIELD_NUMBER: _ClassVar[int]
    SERVER_INFLIGHT_LIMIT_FIELD_NUMBER: _ClassVar[int]
    SERVER_STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVER_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_POOL_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_BACKEND_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    sequences: int
    tokens: int
    stored_bytes: int
    quota_bytes: int
    evictions: int
    k_bits_per_element: float
    v_bits_per_element: float
    prefix_blocks: int
    prefix_bytes: int
    retained_prefix_bytes: int
    shared_tokens: int
    client_inflight: int
    client_inflight_limit: int
    server_inflight_limit: int
    server_stored_bytes: int
    server_capacity_bytes: int
    memory_pool: str
    compute_backend: str
    uptime_seconds: float
    def __init__(self, tenant: _Optional[str] = ..., sequences: _Optional[int] = ..., tokens: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., quota_bytes: _Optional[int] = ..., evictions: _Optional[int] = ..., k_bits_per_element: _Optional[float] = ..., v_bits_per_element: _Optional[float] = ..., prefix_blocks: _Optional[int] = ..., prefix_bytes: _Optional[int] = ..., retained_prefix_bytes: _Optional[int] = ..., shared_tokens: _Optional[int] = ..., client_inflight: _Optional[int] = ..., client_inflight_limit: _Optional[int] = ..., server_inflight_limit: _Optional[int] = ..., server_stored_bytes: _Optional[int] = ..., server_capacity_bytes: _Optional[int] = ..., memory_pool: _Optional[str] = ..., compute_backend: _Optional[str] = ..., uptime_seconds: _Optional[float] = ...) -> None: ...

class EchoRequest(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...

class EchoResponse(_message.Message):
    __slots__ = ("payload",)
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    def __init__(self, payload: _Optional[bytes] = ...) -> None: ...
