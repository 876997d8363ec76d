"""Compiles serialized `xla.HloModuleProto` bytes with jax's XLA client and runs them.

This is the only module of fax_bridge that touches private jax APIs (jax 0.10.2), with
`hlo_import.py`, the helper process it runs XLA's HLO import in, and `hlo_lax.py` /
`hlo_lax_ops.py`, which read a module into lax operations with jaxlib's MLIR bindings
(`HloExecutable.lax_program`; `call_traced` runs it inside `reading_as_lax()`):
HLO -> StableHLO conversion, compilation with the default jax backend, raw executable
calls, the module as a call inside a traced (jitted) jax function
(`HloExecutable.call_traced`, through a `jax.export.Exported` built from the module),
and portable StableHLO artifacts for older consumers (`portable_artifact`). Everything
else goes through `HloExecutable`, `is_traced`, `portable_artifact`, `program_text`,
`to_stablehlo` and `canonical_convolutions` (what `call_traced` inlines on CPU).

Module bytes are untrusted (a user's file, a device's Load request): `to_stablehlo`
checks their structure first (`hlo_check`), then has XLA import them in a helper process
(`hlo_import`), so a module that would stop XLA on an internal CHECK, or crash it, gives
an `HloModuleError` naming it instead of taking the caller's process down. Verdicts are
cached by the bytes' sha256: each module is imported once per process, then compiled;
a helper lost to something other than the module (killed from outside, past its time
limit) leaves no verdict.

Custom calls (LAPACK kernels behind `jnp.linalg`, python callbacks behind
`jax.debug.print` / `pure_callback`) are native code outside the HLO: a process that did
not register the same handlers crashes running them. `custom_calls` lists them; modules
holding any are refused here, before compilation, and by the exporter.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import hashlib
import re
import threading
from typing import Iterator, Optional, Sequence

import jax
import numpy as np
from jax._src import compiler as _compiler
from jax._src import core as _core
from jax._src import xla_bridge as _xla_bridge
from jax._src.interpreters import mlir as _mlir
from jax._src.lib import _jax
from jax._src.lib.mlir import ir as _ir
from jax._src.lib.mlir.dialects import hlo as _hlo_dialect

from fax_bridge.errors import ComputationError, HloModuleError
from fax_bridge.language import jax_compat
from fax_bridge.runtime import hlo_check, hlo_import, hlo_lax, limits, portable_fma

_COPY = _jax.HostBufferSemantics.IMMUTABLE_ONLY_DURING_CALL
# Set while a batched caller traces: `call_traced` reads modules as lax operations.
_AS_LAX: contextvars.ContextVar[bool] = contextvars.ContextVar("as_lax", default=False)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Shape and numpy dtype of one HLO parameter or result."""

    shape: tuple[int, ...]
    dtype: Optional[np.dtype]

    def __str__(self) -> str:
        name = "?" if self.dtype is None else np.dtype(self.dtype).name
        return f"{name}{list(self.shape)}"


def _spec_of(mlir_type) -> TensorSpec:
    tensor = _ir.RankedTensorType(mlir_type)
    return TensorSpec(tuple(int(d) for d in tensor.shape),
                      hlo_lax.element_dtype(tensor.element_type))


def _signature(stablehlo: bytes) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Reads the parameter and result tensor specs of the module's `main` function."""
    with _mlir.make_ir_context():
        module = _ir.Module.parse(stablehlo)
        for op in module.body.operations:
            if _ir.StringAttr(op.attributes["sym_name"]).value != "main":
                continue
            fn_type = _ir.FunctionType(_ir.TypeAttr(op.attributes["function_type"]).value)
            return ([_spec_of(t) for t in fn_type.inputs],
                    [_spec_of(t) for t in hlo_lax.flat_types(fn_type.results)])
    raise ComputationError("the HLO module has no entry function `main`")


# The type URL under which an `Xla` computation holds its serialized HloModuleProto.
HLO_MODULE_TYPE_URL = "type.googleapis.com/xla.HloModuleProto"
# The StableHLO version TensorFlow 2.14's XlaCallModule (op version 8) deserializes.
PORTABLE_TARGET = "0.9.0"
_importer = hlo_import.Importer()


class _Verdicts:
    """Imported modules by sha256, least recently used dropped first past `max_bytes`:
    StableHLO bytes, or the error a refused module gives (so a module that killed the
    helper is not run again)."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def _size(verdict) -> int:
        return len(verdict) if isinstance(verdict, bytes) else 1024

    def get(self, key: str):
        with self._lock:
            verdict = self._entries.get(key)
            if verdict is not None:
                self._entries.move_to_end(key)
            return verdict

    def put(self, key: str, verdict) -> None:
        size = self._size(verdict)
        with self._lock:
            if key in self._entries or size > self.max_bytes:
                return
            self._entries[key] = verdict
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= self._size(old)


_verdicts = _Verdicts()


def to_stablehlo(hlo_module: bytes) -> bytes:
    """Serialized HloModuleProto bytes as StableHLO bytecode, checked and imported where a
    crash of XLA cannot reach the caller (see the module docstring).

    Raises HloModuleError naming the module and the fault (a structural one found by
    `hlo_check`, XLA's refusal, or XLA dying in the helper process).
    """
    key = hashlib.sha256(hlo_module).hexdigest()
    verdict = _verdicts.get(key)
    if verdict is None:
        verdict, judged = _import(hlo_module)
        if judged:
            _verdicts.put(key, verdict)
    if isinstance(verdict, HloModuleError):
        raise HloModuleError(str(verdict))
    return verdict


def _import(hlo_module: bytes) -> tuple:
    """(StableHLO bytes or the HloModuleError to raise, whether that is the module's
    verdict, to give every time).

    A helper XLA crashed is tried once more in a fresh helper: a crash both times is
    the module's verdict. A helper that died otherwise (killed from outside, or past
    its time limit) judged nothing: the error says so and is not kept, so the next
    call imports the module again."""
    try:
        hlo_check.check_module(hlo_module)
    except HloModuleError as e:
        return e, True
    label = hlo_check.module_label(hlo_module)
    crashed = True
    try:
        try:
            converted, payload = _importer.convert(hlo_module)
        except hlo_import.Died as first:
            if first.timed_out:  # waiting again would double the caller's wait
                raise
            crashed = first.crash
            converted, payload = _importer.convert(hlo_module)  # a fresh helper
    except hlo_import.Died as e:
        if not (e.crash and crashed):
            return HloModuleError(
                f"XLA's import of the Xla computation's {label} was cut short: {e}. Its "
                "helper process was lost, not judged the module; run it again (raise "
                "hlo_import.TIMEOUT_SECONDS for a module that takes XLA longer)"), False
        return HloModuleError(
            f"XLA died reading the Xla computation's {label}: {e}, in two helper "
            "processes. The module passed fax_bridge's structural checks but is "
            "malformed in a way XLA does not survive; only its helper processes were "
            "lost. Re-export the computation"), True
    if not converted:
        return HloModuleError(
            f"XLA cannot read the Xla computation's {label} "
            f"({payload.decode(errors='replace')[:2000]}); it must be the bytes of a "
            "serialized xla.HloModuleProto"), True
    return payload, True


def portable_artifact(hlo_module: bytes, target: str = PORTABLE_TARGET
                      ) -> tuple[bytes, list[TensorSpec], list[TensorSpec]]:
    """A serialized HloModuleProto as a portable StableHLO artifact for `target`.

    Returns (artifact bytes, parameter specs, result specs). The artifact is what
    `XlaCallModule` (version >= 5) takes as its `module` attribute.
    """
    try:
        stablehlo = to_stablehlo(hlo_module)
        params, results = _signature(stablehlo)
        artifact = stablehlo_artifact(stablehlo, target)
    except HloModuleError as e:
        raise HloModuleError(
            f"cannot convert the HLO module to a StableHLO {target} artifact: {e}") from None
    except ComputationError:
        raise
    except Exception as e:  # the converters raise plain RuntimeErrors
        raise ComputationError(
            f"cannot convert the HLO module to a StableHLO {target} artifact ({e})") from e
    return bytes(artifact), params, results


def stablehlo_artifact(stablehlo: bytes, target: str = PORTABLE_TARGET) -> bytes:
    """StableHLO bytecode (or text) as a portable artifact for `target`; a narrow-float
    `stablehlo.fma` an older target has no op for is first rewritten with the same bits
    (`portable_fma`)."""
    try:
        return bytes(_jax.mlir.serialize_portable_artifact(stablehlo, target))
    except Exception as e:  # the serializer raises plain runtime errors
        if "fma" not in str(e):
            raise
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    with mlir.make_ir_context(), ir.Location.unknown():
        module = ir.Module.parse(stablehlo)
        portable_fma.fma_as_float64(module, ir)
        stablehlo = mlir.module_to_bytecode(module)
    return bytes(_jax.mlir.serialize_portable_artifact(stablehlo, target))


@dataclasses.dataclass(frozen=True)
class CustomCall:
    """One custom-call operation: its target, the jax operation and the source line."""

    target: str
    operation: str
    where: str

    def __str__(self) -> str:
        at = f" at {self.where}" if self.where else ""
        return f"custom call `{self.target}` (from `{self.operation}`{at})"


# Targets XLA itself implements (sharding annotations for its partitioner), not native code.
XLA_OWN_TARGETS = frozenset({"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"})
_FILE_LINE = re.compile(r'"([^"]+)":(\d+):\d+')
_NAME = re.compile(r'loc\("([^"]+)"')


def custom_calls(module) -> list[CustomCall]:
    """The custom-call operations of a StableHLO `ir.Module`, with where they come from.

    A custom call inside a private function (jax lowers `jnp.linalg.solve` as one) carries
    only the operation's name; its source line is that of the first call reaching it.
    """
    callers: dict[str, str] = {}
    found: list[tuple[object, str]] = []

    def visit(op):
        name = op.name
        if name == "func.call":
            callee = str(op.attributes["callee"]).lstrip("@")
            callers.setdefault(callee, str(op.location))
        elif name == "stablehlo.custom_call":
            found.append((op, str(op.location)))
        return _ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    calls = []
    for op, location in found:
        target = _ir.StringAttr(op.attributes["call_target_name"]).value
        if target in XLA_OWN_TARGETS:
            continue
        names = _NAME.findall(location)
        operation = names[0].rsplit("/", 1)[-1].rstrip(":") if names else target
        where = _FILE_LINE.search(location)
        parent, hops = op.parent, 0
        while where is None and parent is not None and hops < 64:
            if parent.name == "func.func":
                fn = _ir.StringAttr(parent.attributes["sym_name"]).value
                location = callers.get(fn, "")
                where = _FILE_LINE.search(location)
                if not location:
                    break
                parent = _enclosing_func_of_call(module, fn)
            else:
                parent = parent.parent
            hops += 1
        calls.append(CustomCall(target, operation,
                                f"{where.group(1)}:{where.group(2)}" if where else ""))
    return calls


def _enclosing_func_of_call(module, callee: str):
    """The function holding the first call of `callee` (None when there is none)."""
    holder = []

    def visit(op):
        if op.name == "func.call" and str(op.attributes["callee"]).lstrip("@") == callee:
            parent = op.parent
            while parent is not None and parent.name != "func.func":
                parent = parent.parent
            holder.append(parent)
            return _ir.WalkResult.INTERRUPT
        return _ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return holder[0] if holder else None


def _refuse_custom_calls(stablehlo: bytes) -> None:
    with _mlir.make_ir_context():
        calls = custom_calls(_ir.Module.parse(stablehlo))
    if calls:
        listed = "; ".join(str(c) for c in calls[:5])
        more = f" and {len(calls) - 5} more" if len(calls) > 5 else ""
        raise ComputationError(
            f"the HLO module holds {len(calls)} custom call(s): {listed}{more}. Custom calls "
            "run native code outside the HLO (LAPACK kernels, python callbacks) that this "
            "process cannot vouch for, so they are refused before compilation; export "
            "local functions without jnp.linalg decompositions or jax.debug/callbacks")


def program_text(hlo_module: bytes) -> str:
    """The module's StableHLO text without source locations: what it computes, the same
    in every process that builds it (HLO bytes also carry where it was built)."""
    stablehlo = to_stablehlo(hlo_module)
    try:
        with _mlir.make_ir_context():
            return _ir.Module.parse(stablehlo).operation.get_asm(enable_debug_info=False)
    except Exception as e:  # the converters raise plain RuntimeErrors
        raise ComputationError(f"cannot read the Xla computation's HloModuleProto ({e})") from e


class HloExecutable:
    """An HLO module to call with numpy arrays, giving a list of numpy arrays (XLA compiles
    it on the first call)."""

    def __init__(self, hlo_module: bytes, platform: Optional[str] = None,
                 stablehlo: Optional[bytes] = None):
        """`stablehlo`: the module as StableHLO bytecode already (`hlo_module` ignored)."""
        if stablehlo is None:
            stablehlo = to_stablehlo(hlo_module)
        try:
            self.parameters, self.results = _signature(stablehlo)
        except ComputationError:
            raise
        except Exception as e:
            raise ComputationError(f"cannot read the HLO module's signature ({e})") from e
        try:
            _refuse_custom_calls(stablehlo)
        except ComputationError:
            raise
        except Exception as e:
            raise ComputationError(f"cannot read the HLO module's operations ({e})") from e
        for where, specs in (("parameter", self.parameters), ("result", self.results)):
            for i, spec in enumerate(specs):
                itemsize = spec.dtype.itemsize if spec.dtype is not None else 8
                limits.tensor_bytes(spec.shape, itemsize, f"HLO {where} {i}")
        unknown = [i for i, p in enumerate(self.parameters) if p.dtype is None]
        if unknown:
            raise ComputationError(
                f"HLO parameters {unknown} have element types without a numpy dtype")
        self._stablehlo = stablehlo
        self._exported: Optional[jax.export.Exported] = None
        backend = _xla_bridge.get_backend(platform)
        self._device = backend.devices()[0]
        self._sharding = jax.sharding.make_single_device_sharding(self._device)
        self._avals = [_core.ShapedArray(p.shape, p.dtype) for p in self.parameters]
        self._backend = backend
        self._executable = None  # compiled on first call: a module that only ever runs
        self._compiling = threading.Lock()  # inside `call_traced` is never compiled alone
        self._program: Optional[hlo_lax.Program] = None
        self._unreadable: Optional[str] = None

    def lax_program(self) -> hlo_lax.Program:
        """The module read as lax operations (`hlo_lax.read`, once); raises
        `hlo_lax.Unreadable` naming what it cannot read."""
        if self._program is None and self._unreadable is None:
            try:
                self._program = hlo_lax.read(self._stablehlo)
            except hlo_lax.Unreadable as e:
                self._unreadable = str(e)
        if self._program is None:
            raise hlo_lax.Unreadable(self._unreadable)
        return self._program

    def _compiled(self):
        with self._compiling:
            if self._executable is None:
                options = _compiler.get_compile_options(num_replicas=1, num_partitions=1)
                try:
                    self._executable = self._backend.compile_and_load(
                        self._stablehlo, _jax.DeviceList((self._device,)), options)
                except Exception as e:
                    raise ComputationError(f"XLA could not compile the HLO module: {e}"
                                           ) from e
        return self._executable

    def __call__(self, args: Sequence[np.ndarray]) -> list[np.ndarray]:
        if len(args) != len(self.parameters):
            raise ComputationError(
                f"the HLO module takes {len(self.parameters)} parameters, got {len(args)}"
            )
        arrays = []
        for i, (arg, spec) in enumerate(zip(args, self.parameters)):
            arr = np.asarray(arg)
            if spec.dtype is not None and arr.dtype != spec.dtype:
                arr = arr.astype(spec.dtype)
            if arr.shape != spec.shape:
                raise ComputationError(
                    f"HLO parameter {i} expects {spec}, got an array of shape "
                    f"{list(arr.shape)}"
                )
            arrays.append(arr)
        executable = self._executable or self._compiled()
        try:
            # A direct host-to-device copy per parameter (jax.device_put costs ~10x
            # more per call); enable_x64 keeps 64-bit types as they are.
            buffers = [
                _jax.batched_device_put(aval, self._sharding, [np.ascontiguousarray(a)],
                                        [self._device], True, False, _COPY, True)
                for aval, a in zip(self._avals, arrays)
            ]
            outs = executable.execute(buffers)
        except Exception as e:
            raise ComputationError(f"XLA execution failed: {e}") from e
        # Copied out: a view would keep XLA's buffer (and its allocation, kilobytes even
        # for a scalar) alive for as long as a device holds the result.
        return [np.array(o, copy=True) for o in outs]

    def _export(self) -> jax.export.Exported:
        """The module as a `jax.export.Exported` (one platform, no effects, no shardings):
        its `main` is called, after jax inlines it, by the function being traced. On CPU
        its convolutions are put in canonical form first (`canonical_convolutions`). The
        artifact is read back by this same jaxlib, so it is serialized at this jaxlib's
        own StableHLO version: an older target refuses ops it lacks (jax 0.12 writes
        `fma`, which StableHLO of four weeks before cannot hold)."""
        target = _hlo_dialect.get_version_from_compatibility_requirement(
            _hlo_dialect.StablehloCompatibilityRequirement.NONE)
        stablehlo = self._stablehlo
        if self._backend.platform == "cpu":
            stablehlo = canonical_convolutions(stablehlo)
        artifact = bytes(_jax.mlir.serialize_portable_artifact(stablehlo, target))
        ins = tuple(_core.ShapedArray(p.shape, p.dtype) for p in self.parameters)
        outs = tuple(_core.ShapedArray(r.shape, r.dtype) for r in self.results)
        nothing_in, nothing_out = (None,) * len(ins), (None,) * len(outs)
        return jax_compat.exported(
            fun_name="xla_computation",
            in_tree=jax.tree_util.tree_structure((tuple(range(len(ins))), {})),
            in_avals=ins, out_tree=jax.tree_util.tree_structure(tuple(range(len(outs)))),
            out_avals=outs, _has_named_shardings=False, _in_named_shardings=nothing_in,
            _out_named_shardings=nothing_out, in_shardings_hlo=nothing_in,
            out_shardings_hlo=nothing_out, nr_devices=1,
            platforms=(jax.export.default_export_platform(),), ordered_effects=(),
            unordered_effects=(), disabled_safety_checks=(), mlir_module_serialized=artifact,
            calling_convention_version=9, module_kept_var_idx=tuple(range(len(ins))),
            uses_global_constants=False, _get_vjp=None)

    def call_traced(self, args: Sequence) -> list:
        """The module's outputs for `args` (jax values, tracers among them) inside a
        function jax is tracing: the module is inlined there, so XLA compiles it with its
        caller. Inside `reading_as_lax()` the module runs as its lax operations
        (`lax_program`), which jax can vmap; else as one opaque call.

        Raises ComputationError when the module cannot be called so (64-bit types while
        jax runs with 32-bit ones, a tuple-shaped result, shapes or dtypes that do not
        match).
        """
        specs = [*self.parameters, *self.results]
        if any(s.dtype is None for s in specs):
            raise ComputationError("the HLO module has element types without a numpy dtype")
        wide = [s for s in specs
                if s.dtype.itemsize == 8 and s.dtype.kind != "c" or s.dtype.itemsize == 16]
        if wide and not jax.config.jax_enable_x64:
            raise ComputationError(
                "the HLO module has 64-bit types and jax_enable_x64 is off; it runs only "
                "as its own executable")
        if _AS_LAX.get():
            return list(self.lax_program()(*args))
        try:
            if self._exported is None:
                self._exported = self._export()
            # Barriers on both sides keep XLA from fusing or simplifying across the
            # module's edges, so it computes the same whatever computation calls it.
            args = jax.lax.optimization_barrier(list(args))
            return list(jax.lax.optimization_barrier(list(self._exported.call(*args))))
        except ComputationError:
            raise
        except Exception as e:  # jax raises ValueErrors and MLIR errors of its own
            raise ComputationError(
                f"cannot call the HLO module inside a traced function ({e})") from e


@contextlib.contextmanager
def reading_as_lax() -> Iterator[None]:
    """While it lasts, `call_traced` runs each module as the lax operations it is read
    into (`HloExecutable.lax_program`) instead of as one opaque call, so that what is
    being traced can be vmapped (`client_map`'s batched clients)."""
    token = _AS_LAX.set(True)
    try:
        yield
    finally:
        _AS_LAX.reset(token)


def canonical_convolutions(stablehlo: bytes) -> bytes:
    """The module with every convolution in the canonical form of XLA's CPU backend
    (input NHWC, kernel HWIO, output NHWC), between transposes to and from its own
    dimension order; the bytes unchanged when every one already is.

    XLA's CPU compiler runs a convolution on Eigen's fast kernels only in that form, and
    puts the entry computation's convolutions in it itself (its `ConvCanonicalization`
    pass, the same transposes), but not those of a loop's body, which run on a naive
    kernel instead: a gradient's weight convolution of a small CNN takes several times
    as long there. `call_traced` inlines a module into `client_map`'s loop over clients,
    so the module is canonicalized before, and its convolutions run there as in its own
    executable. Every op keeps its source location (what names the user's line when
    LiteRT refuses an op of the module).
    """
    with _mlir.make_ir_context():
        module = _ir.Module.parse(stablehlo)
        convolutions: list = []

        def visit(op):
            if op.name == "stablehlo.convolution":
                convolutions.append(op)
            return _ir.WalkResult.ADVANCE

        module.operation.walk(visit)
        changed = False
        for op in convolutions:
            changed |= _canonicalize_convolution(op)
        if not changed:
            return stablehlo
        module.operation.verify()
        return bytes(module.operation.get_asm(binary=True, enable_debug_info=True))


def _canonicalize_convolution(op) -> bool:
    """Rewrites one `stablehlo.convolution` as transpose, canonical convolution,
    transpose (`canonical_convolutions`); False when it already is canonical."""
    dims = _hlo_dialect.ConvDimensionNumbers(op.attributes["dimension_numbers"])
    rank = len(dims.input_spatial_dimensions) + 2
    spatial = list(range(1, rank - 1))
    lhs = [dims.input_batch_dimension, *dims.input_spatial_dimensions,
           dims.input_feature_dimension]
    rhs = [*dims.kernel_spatial_dimensions, dims.kernel_input_feature_dimension,
           dims.kernel_output_feature_dimension]
    out = [dims.output_batch_dimension, *dims.output_spatial_dimensions,
           dims.output_feature_dimension]
    if lhs == rhs == out == list(range(rank)):
        return False

    def transpose(value, perm: list):
        t = _ir.RankedTensorType(value.type)
        shape = _ir.RankedTensorType.get([t.shape[p] for p in perm], t.element_type)
        return _ir.Operation.create(
            "stablehlo.transpose", results=[shape], operands=[value],
            attributes={"permutation": _ir.DenseI64ArrayAttr.get(perm)}).result

    with op.location, _ir.InsertionPoint(op):
        attributes = {name: op.attributes[name] for name in op.attributes}
        attributes["dimension_numbers"] = _hlo_dialect.ConvDimensionNumbers.get(
            input_batch_dimension=0, input_feature_dimension=rank - 1,
            input_spatial_dimensions=spatial, kernel_input_feature_dimension=rank - 2,
            kernel_output_feature_dimension=rank - 1,
            kernel_spatial_dimensions=list(range(rank - 2)), output_batch_dimension=0,
            output_feature_dimension=rank - 1, output_spatial_dimensions=spatial)
        result = _ir.RankedTensorType(op.results[0].type)
        shape = _ir.RankedTensorType.get([result.shape[p] for p in out],
                                         result.element_type)
        conv = _ir.Operation.create(
            "stablehlo.convolution", results=[shape],
            operands=[transpose(op.operands[0], lhs), transpose(op.operands[1], rhs)],
            attributes=attributes).result
        back = transpose(conv, [out.index(i) for i in range(rank)])
    op.results[0].replace_all_uses_with(back)
    op.erase()
    return True


def is_traced(value) -> bool:
    """Whether `value` is a jax tracer (an array inside a function jax is tracing)."""
    return isinstance(value, jax.core.Tracer)


def compile_hlo(hlo_module: bytes, platform: Optional[str] = None) -> HloExecutable:
    """Serialized HloModuleProto bytes, read and checked, as an executable for the default
    (or named) jax platform; XLA compiles it on its first call."""
    return HloExecutable(hlo_module, platform)
