from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tile(_message.Message):
    __slots__ = ("dimensions",)
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    dimensions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dimensions: _Optional[_Iterable[int]] = ...) -> None: ...

class Layout(_message.Message):
    __slots__ = ("minor_to_major", "tiles", "element_size_in_bits", "memory_space", "physical_shape")
    MINOR_TO_MAJOR_FIELD_NUMBER: _ClassVar[int]
    TILES_FIELD_NUMBER: _ClassVar[int]
    ELEMENT_SIZE_IN_BITS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SPACE_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    minor_to_major: _containers.RepeatedScalarFieldContainer[int]
    tiles: _containers.RepeatedCompositeFieldContainer[Tile]
    element_size_in_bits: int
    memory_space: int
    physical_shape: Shape
    def __init__(self, minor_to_major: _Optional[_Iterable[int]] = ..., tiles: _Optional[_Iterable[_Union[Tile, _Mapping]]] = ..., element_size_in_bits: _Optional[int] = ..., memory_space: _Optional[int] = ..., physical_shape: _Optional[_Union[Shape, _Mapping]] = ...) -> None: ...

class Shape(_message.Message):
    __slots__ = ("element_type", "dimensions", "tuple_shapes", "layout", "is_dynamic_dimension")
    ELEMENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    TUPLE_SHAPES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    IS_DYNAMIC_DIMENSION_FIELD_NUMBER: _ClassVar[int]
    element_type: int
    dimensions: _containers.RepeatedScalarFieldContainer[int]
    tuple_shapes: _containers.RepeatedCompositeFieldContainer[Shape]
    layout: Layout
    is_dynamic_dimension: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, element_type: _Optional[int] = ..., dimensions: _Optional[_Iterable[int]] = ..., tuple_shapes: _Optional[_Iterable[_Union[Shape, _Mapping]]] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., is_dynamic_dimension: _Optional[_Iterable[bool]] = ...) -> None: ...

class ProgramShape(_message.Message):
    __slots__ = ("parameters", "result", "parameter_names")
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_NAMES_FIELD_NUMBER: _ClassVar[int]
    parameters: _containers.RepeatedCompositeFieldContainer[Shape]
    result: Shape
    parameter_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, parameters: _Optional[_Iterable[_Union[Shape, _Mapping]]] = ..., result: _Optional[_Union[Shape, _Mapping]] = ..., parameter_names: _Optional[_Iterable[str]] = ...) -> None: ...

class Instruction(_message.Message):
    __slots__ = ("name", "opcode", "shape", "parameter_number", "tuple_index", "dimensions", "outfeed_shape", "id", "operand_ids", "control_predecessor_ids", "called_computation_ids", "operand_shapes_with_layout")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OPCODE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_NUMBER_FIELD_NUMBER: _ClassVar[int]
    TUPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    OUTFEED_SHAPE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    OPERAND_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_PREDECESSOR_IDS_FIELD_NUMBER: _ClassVar[int]
    CALLED_COMPUTATION_IDS_FIELD_NUMBER: _ClassVar[int]
    OPERAND_SHAPES_WITH_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    opcode: str
    shape: Shape
    parameter_number: int
    tuple_index: int
    dimensions: _containers.RepeatedScalarFieldContainer[int]
    outfeed_shape: Shape
    id: int
    operand_ids: _containers.RepeatedScalarFieldContainer[int]
    control_predecessor_ids: _containers.RepeatedScalarFieldContainer[int]
    called_computation_ids: _containers.RepeatedScalarFieldContainer[int]
    operand_shapes_with_layout: _containers.RepeatedCompositeFieldContainer[Shape]
    def __init__(self, name: _Optional[str] = ..., opcode: _Optional[str] = ..., shape: _Optional[_Union[Shape, _Mapping]] = ..., parameter_number: _Optional[int] = ..., tuple_index: _Optional[int] = ..., dimensions: _Optional[_Iterable[int]] = ..., outfeed_shape: _Optional[_Union[Shape, _Mapping]] = ..., id: _Optional[int] = ..., operand_ids: _Optional[_Iterable[int]] = ..., control_predecessor_ids: _Optional[_Iterable[int]] = ..., called_computation_ids: _Optional[_Iterable[int]] = ..., operand_shapes_with_layout: _Optional[_Iterable[_Union[Shape, _Mapping]]] = ...) -> None: ...

class Computation(_message.Message):
    __slots__ = ("name", "instructions", "program_shape", "id", "root_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_SHAPE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    ROOT_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    instructions: _containers.RepeatedCompositeFieldContainer[Instruction]
    program_shape: ProgramShape
    id: int
    root_id: int
    def __init__(self, name: _Optional[str] = ..., instructions: _Optional[_Iterable[_Union[Instruction, _Mapping]]] = ..., program_shape: _Optional[_Union[ProgramShape, _Mapping]] = ..., id: _Optional[int] = ..., root_id: _Optional[int] = ...) -> None: ...

class Module(_message.Message):
    __slots__ = ("name", "entry_computation_name", "computations", "host_program_shape", "id", "entry_computation_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENTRY_COMPUTATION_NAME_FIELD_NUMBER: _ClassVar[int]
    COMPUTATIONS_FIELD_NUMBER: _ClassVar[int]
    HOST_PROGRAM_SHAPE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    ENTRY_COMPUTATION_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    entry_computation_name: str
    computations: _containers.RepeatedCompositeFieldContainer[Computation]
    host_program_shape: ProgramShape
    id: int
    entry_computation_id: int
    def __init__(self, name: _Optional[str] = ..., entry_computation_name: _Optional[str] = ..., computations: _Optional[_Iterable[_Union[Computation, _Mapping]]] = ..., host_program_shape: _Optional[_Union[ProgramShape, _Mapping]] = ..., id: _Optional[int] = ..., entry_computation_id: _Optional[int] = ...) -> None: ...
