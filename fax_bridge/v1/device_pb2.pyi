from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Aggregation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AGGREGATION_UNSPECIFIED: _ClassVar[Aggregation]
    SUM: _ClassVar[Aggregation]
    MEAN: _ClassVar[Aggregation]
    WEIGHTED_MEAN: _ClassVar[Aggregation]
    MIN: _ClassVar[Aggregation]
    MAX: _ClassVar[Aggregation]
    SECURE_SUM_BITWIDTH: _ClassVar[Aggregation]
    SECURE_SUM: _ClassVar[Aggregation]
AGGREGATION_UNSPECIFIED: Aggregation
SUM: Aggregation
MEAN: Aggregation
WEIGHTED_MEAN: Aggregation
MIN: Aggregation
MAX: Aggregation
SECURE_SUM_BITWIDTH: Aggregation
SECURE_SUM: Aggregation

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "data_at")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DATA_AT_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    data_at: SharedSpan
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., data_at: _Optional[_Union[SharedSpan, _Mapping]] = ...) -> None: ...

class SharedSpan(_message.Message):
    __slots__ = ("offset", "length")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class SharedSegment(_message.Message):
    __slots__ = ("name", "generation", "length")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    generation: int
    length: int
    def __init__(self, name: _Optional[str] = ..., generation: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class Value(_message.Message):
    __slots__ = ("tensor", "struct")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    STRUCT_FIELD_NUMBER: _ClassVar[int]
    tensor: Tensor
    struct: Struct
    def __init__(self, tensor: _Optional[_Union[Tensor, _Mapping]] = ..., struct: _Optional[_Union[Struct, _Mapping]] = ...) -> None: ...

class Struct(_message.Message):
    __slots__ = ("elements",)
    ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    elements: _containers.RepeatedCompositeFieldContainer[Element]
    def __init__(self, elements: _Optional[_Iterable[_Union[Element, _Mapping]]] = ...) -> None: ...

class Element(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: Value
    def __init__(self, name: _Optional[str] = ..., value: _Optional[_Union[Value, _Mapping]] = ...) -> None: ...

class ClientValue(_message.Message):
    __slots__ = ("client_id", "value")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    value: Value
    def __init__(self, client_id: _Optional[int] = ..., value: _Optional[_Union[Value, _Mapping]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "device_id", "pid", "protocol", "num_handles", "num_computations", "num_clients", "population_name", "population_clients", "population_digest", "shared_memory_dir")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    NUM_HANDLES_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    POPULATION_NAME_FIELD_NUMBER: _ClassVar[int]
    POPULATION_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    POPULATION_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_DIR_FIELD_NUMBER: _ClassVar[int]
    status: str
    device_id: str
    pid: int
    protocol: str
    num_handles: int
    num_computations: int
    num_clients: int
    population_name: str
    population_clients: int
    population_digest: str
    shared_memory_dir: str
    def __init__(self, status: _Optional[str] = ..., device_id: _Optional[str] = ..., pid: _Optional[int] = ..., protocol: _Optional[str] = ..., num_handles: _Optional[int] = ..., num_computations: _Optional[int] = ..., num_clients: _Optional[int] = ..., population_name: _Optional[str] = ..., population_clients: _Optional[int] = ..., population_digest: _Optional[str] = ..., shared_memory_dir: _Optional[str] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("computation_hash", "computation")
    COMPUTATION_HASH_FIELD_NUMBER: _ClassVar[int]
    COMPUTATION_FIELD_NUMBER: _ClassVar[int]
    computation_hash: str
    computation: bytes
    def __init__(self, computation_hash: _Optional[str] = ..., computation: _Optional[bytes] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("already_loaded",)
    ALREADY_LOADED_FIELD_NUMBER: _ClassVar[int]
    already_loaded: bool
    def __init__(self, already_loaded: _Optional[bool] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("handle", "values", "from_store")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    FROM_STORE_FIELD_NUMBER: _ClassVar[int]
    handle: int
    values: _containers.RepeatedCompositeFieldContainer[ClientValue]
    from_store: StoreRead
    def __init__(self, handle: _Optional[int] = ..., values: _Optional[_Iterable[_Union[ClientValue, _Mapping]]] = ..., from_store: _Optional[_Union[StoreRead, _Mapping]] = ...) -> None: ...

class ClientRange(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class StoreRead(_message.Message):
    __slots__ = ("population", "first_client", "population_ids", "ranges", "member_type", "keys")
    POPULATION_FIELD_NUMBER: _ClassVar[int]
    FIRST_CLIENT_FIELD_NUMBER: _ClassVar[int]
    POPULATION_IDS_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    MEMBER_TYPE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    population: str
    first_client: int
    population_ids: _containers.RepeatedScalarFieldContainer[int]
    ranges: _containers.RepeatedCompositeFieldContainer[ClientRange]
    member_type: bytes
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, population: _Optional[str] = ..., first_client: _Optional[int] = ..., population_ids: _Optional[_Iterable[int]] = ..., ranges: _Optional[_Iterable[_Union[ClientRange, _Mapping]]] = ..., member_type: _Optional[bytes] = ..., keys: _Optional[_Iterable[str]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("num_clients",)
    NUM_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    num_clients: int
    def __init__(self, num_clients: _Optional[int] = ...) -> None: ...

class BroadcastRequest(_message.Message):
    __slots__ = ("handle", "value", "client_ids", "client_range")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_IDS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_RANGE_FIELD_NUMBER: _ClassVar[int]
    handle: int
    value: Value
    client_ids: _containers.RepeatedScalarFieldContainer[int]
    client_range: ClientRange
    def __init__(self, handle: _Optional[int] = ..., value: _Optional[_Union[Value, _Mapping]] = ..., client_ids: _Optional[_Iterable[int]] = ..., client_range: _Optional[_Union[ClientRange, _Mapping]] = ...) -> None: ...

class BroadcastResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MapRequest(_message.Message):
    __slots__ = ("computation_hash", "arg", "result", "delay_seconds", "no_argument")
    COMPUTATION_HASH_FIELD_NUMBER: _ClassVar[int]
    ARG_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    DELAY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NO_ARGUMENT_FIELD_NUMBER: _ClassVar[int]
    computation_hash: str
    arg: int
    result: int
    delay_seconds: float
    no_argument: bool
    def __init__(self, computation_hash: _Optional[str] = ..., arg: _Optional[int] = ..., result: _Optional[int] = ..., delay_seconds: _Optional[float] = ..., no_argument: _Optional[bool] = ...) -> None: ...

class MapResponse(_message.Message):
    __slots__ = ("num_clients", "compute_seconds", "client_runtime")
    NUM_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_RUNTIME_FIELD_NUMBER: _ClassVar[int]
    num_clients: int
    compute_seconds: float
    client_runtime: str
    def __init__(self, num_clients: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., client_runtime: _Optional[str] = ...) -> None: ...

class ZipField(_message.Message):
    __slots__ = ("handle", "name")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    handle: int
    name: str
    def __init__(self, handle: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class ZipRequest(_message.Message):
    __slots__ = ("fields", "result")
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    fields: _containers.RepeatedCompositeFieldContainer[ZipField]
    result: int
    def __init__(self, fields: _Optional[_Iterable[_Union[ZipField, _Mapping]]] = ..., result: _Optional[int] = ...) -> None: ...

class ZipResponse(_message.Message):
    __slots__ = ("num_clients",)
    NUM_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    num_clients: int
    def __init__(self, num_clients: _Optional[int] = ...) -> None: ...

class LeafPartial(_message.Message):
    __slots__ = ("dtype", "shape", "base_limb", "num_limbs", "limbs", "extreme", "nonfinite", "doubles", "spilled", "limbs_at", "nonfinite_at", "doubles_at", "spilled_at", "addend")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BASE_LIMB_FIELD_NUMBER: _ClassVar[int]
    NUM_LIMBS_FIELD_NUMBER: _ClassVar[int]
    LIMBS_FIELD_NUMBER: _ClassVar[int]
    EXTREME_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_FIELD_NUMBER: _ClassVar[int]
    DOUBLES_FIELD_NUMBER: _ClassVar[int]
    SPILLED_FIELD_NUMBER: _ClassVar[int]
    LIMBS_AT_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_AT_FIELD_NUMBER: _ClassVar[int]
    DOUBLES_AT_FIELD_NUMBER: _ClassVar[int]
    SPILLED_AT_FIELD_NUMBER: _ClassVar[int]
    ADDEND_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    base_limb: int
    num_limbs: int
    limbs: bytes
    extreme: Tensor
    nonfinite: bytes
    doubles: bytes
    spilled: bytes
    limbs_at: SharedSpan
    nonfinite_at: SharedSpan
    doubles_at: SharedSpan
    spilled_at: SharedSpan
    addend: Tensor
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., base_limb: _Optional[int] = ..., num_limbs: _Optional[int] = ..., limbs: _Optional[bytes] = ..., extreme: _Optional[_Union[Tensor, _Mapping]] = ..., nonfinite: _Optional[bytes] = ..., doubles: _Optional[bytes] = ..., spilled: _Optional[bytes] = ..., limbs_at: _Optional[_Union[SharedSpan, _Mapping]] = ..., nonfinite_at: _Optional[_Union[SharedSpan, _Mapping]] = ..., doubles_at: _Optional[_Union[SharedSpan, _Mapping]] = ..., spilled_at: _Optional[_Union[SharedSpan, _Mapping]] = ..., addend: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class AggregateRequest(_message.Message):
    __slots__ = ("value", "kind", "weights", "bitwidth")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    BITWIDTH_FIELD_NUMBER: _ClassVar[int]
    value: int
    kind: Aggregation
    weights: int
    bitwidth: Value
    def __init__(self, value: _Optional[int] = ..., kind: _Optional[_Union[Aggregation, str]] = ..., weights: _Optional[int] = ..., bitwidth: _Optional[_Union[Value, _Mapping]] = ...) -> None: ...

class AggregateResponse(_message.Message):
    __slots__ = ("leaves", "weight_leaves", "num_clients")
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_LEAVES_FIELD_NUMBER: _ClassVar[int]
    NUM_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    leaves: _containers.RepeatedCompositeFieldContainer[LeafPartial]
    weight_leaves: _containers.RepeatedCompositeFieldContainer[LeafPartial]
    num_clients: int
    def __init__(self, leaves: _Optional[_Iterable[_Union[LeafPartial, _Mapping]]] = ..., weight_leaves: _Optional[_Iterable[_Union[LeafPartial, _Mapping]]] = ..., num_clients: _Optional[int] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("handle", "max_message_bytes")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    handle: int
    max_message_bytes: int
    def __init__(self, handle: _Optional[int] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class FetchResponse(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedCompositeFieldContainer[ClientValue]
    def __init__(self, values: _Optional[_Iterable[_Union[ClientValue, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("handles",)
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    handles: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, handles: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class RoundAggregation(_message.Message):
    __slots__ = ("kind", "value_index", "weight_index", "bound")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUE_INDEX_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_INDEX_FIELD_NUMBER: _ClassVar[int]
    BOUND_FIELD_NUMBER: _ClassVar[int]
    kind: Aggregation
    value_index: int
    weight_index: int
    bound: Value
    def __init__(self, kind: _Optional[_Union[Aggregation, str]] = ..., value_index: _Optional[int] = ..., weight_index: _Optional[int] = ..., bound: _Optional[_Union[Value, _Mapping]] = ...) -> None: ...

class RoundRequest(_message.Message):
    __slots__ = ("computation_hash", "broadcast", "aggregations", "values", "from_store", "delay_seconds", "broadcast_segment", "answer_segment", "rounded_partials")
    COMPUTATION_HASH_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_FIELD_NUMBER: _ClassVar[int]
    AGGREGATIONS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    FROM_STORE_FIELD_NUMBER: _ClassVar[int]
    DELAY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    ANSWER_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    ROUNDED_PARTIALS_FIELD_NUMBER: _ClassVar[int]
    computation_hash: str
    broadcast: Value
    aggregations: _containers.RepeatedCompositeFieldContainer[RoundAggregation]
    values: _containers.RepeatedCompositeFieldContainer[ClientValue]
    from_store: StoreRead
    delay_seconds: float
    broadcast_segment: SharedSegment
    answer_segment: SharedSegment
    rounded_partials: bool
    def __init__(self, computation_hash: _Optional[str] = ..., broadcast: _Optional[_Union[Value, _Mapping]] = ..., aggregations: _Optional[_Iterable[_Union[RoundAggregation, _Mapping]]] = ..., values: _Optional[_Iterable[_Union[ClientValue, _Mapping]]] = ..., from_store: _Optional[_Union[StoreRead, _Mapping]] = ..., delay_seconds: _Optional[float] = ..., broadcast_segment: _Optional[_Union[SharedSegment, _Mapping]] = ..., answer_segment: _Optional[_Union[SharedSegment, _Mapping]] = ..., rounded_partials: _Optional[bool] = ...) -> None: ...

class RoundResponse(_message.Message):
    __slots__ = ("partials", "num_clients", "compute_seconds", "segment", "client_runtime", "model_sha256")
    PARTIALS_FIELD_NUMBER: _ClassVar[int]
    NUM_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_RUNTIME_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    partials: _containers.RepeatedCompositeFieldContainer[AggregateResponse]
    num_clients: int
    compute_seconds: float
    segment: SharedSegment
    client_runtime: str
    model_sha256: str
    def __init__(self, partials: _Optional[_Iterable[_Union[AggregateResponse, _Mapping]]] = ..., num_clients: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., segment: _Optional[_Union[SharedSegment, _Mapping]] = ..., client_runtime: _Optional[str] = ..., model_sha256: _Optional[str] = ...) -> None: ...
