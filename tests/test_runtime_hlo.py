"""Tests of fax_bridge.runtime.hlo: HloModuleProto bytes compiled and run on numpy arrays."""

import re
import string
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fax_bridge.system import forks
from fax_bridge.errors import ComputationError, ExportError, HloModuleError
from fax_bridge.runtime import hlo, hlo_import
from fax_bridge.tff import xla as tff_xla
from sample_computations import conv_weight_gradient


@pytest.fixture(scope="module")
def fork_server():
    """A fork server holding what the one that forks a fleet's devices holds (jaxlib
    and fax_bridge's device modules: a helper it forks imports nothing more)."""
    import os
    import sys

    from fax_bridge.fleet.launcher import DEVICE_MODULES

    if not forks.available():
        pytest.skip("needs Linux pidfds")
    server = forks.ForkServer.start(sys.executable, dict(os.environ, OMP_NUM_THREADS="1"),
                                    list(DEVICE_MODULES))
    yield server
    server.close()


@pytest.fixture(params=["fresh", "forked"])
def helpers(request, monkeypatch):
    """Where the helper processes come from: a fresh interpreter each, or (as in a
    device forked by `fax_bridge.system.forks`) forked by the server that forked this process.
    Either way the process has its own importer and remembers no verdict yet."""
    if request.param == "forked":
        server = request.getfixturevalue("fork_server")
        monkeypatch.setattr(forks.ForkServer, "inherited", classmethod(lambda cls: server))
    monkeypatch.setattr(hlo, "_importer", hlo_import.Importer())
    monkeypatch.setattr(hlo, "_verdicts", hlo._Verdicts())
    return request.param


def _hlo(fn, *specs):
    return jax.jit(fn, keep_unused=True).lower(*specs).compiler_ir(
        "hlo").as_serialized_hlo_module_proto()


def test_signature_and_call():
    exe = hlo.compile_hlo(_hlo(lambda a, b: (a @ b, b.sum()),
                               np.zeros((2, 3), np.float32), np.zeros((3, 4), np.float32)))
    assert [p.shape for p in exe.parameters] == [(2, 3), (3, 4)]
    assert [str(r) for r in exe.results] == ["float32[2, 4]", "float32[]"]
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.ones((3, 4), np.float32)
    prod, total = exe([a, b])
    np.testing.assert_allclose(prod, a @ b)
    assert total == 12.0


# A weight gradient: jax writes it as a convolution in a non-canonical order.
_conv_gradient = conv_weight_gradient(("NCHW", "OIHW", "NCHW"))


def _conv_labels(compiled_text: str) -> list[str]:
    return re.findall(r"convolution\(.*?dim_labels=([^,\s]+)", compiled_text)


def test_convolutions_inlined_in_a_loop_are_canonical_with_the_bits_of_their_executable():
    k = np.zeros((4, 2, 3, 3), np.float32)
    x = np.zeros((3, 2, 9, 9), np.float32)
    module = _hlo(_conv_gradient, k, x)
    stablehlo = hlo.to_stablehlo(module)
    rewritten = hlo.canonical_convolutions(stablehlo)
    assert rewritten != stablehlo
    assert hlo.canonical_convolutions(rewritten) == rewritten  # nothing left to rewrite
    exe = hlo.compile_hlo(module)

    def loop(k, xs):  # XLA's CPU compiler leaves a loop body's convolutions as they are
        return jax.lax.fori_loop(0, xs.shape[0],
                                 lambda i, out: out.at[i].set(exe.call_traced([k, xs[i]])[0]),
                                 jnp.zeros((xs.shape[0], *k.shape), k.dtype))

    rng = np.random.default_rng(0)
    kernel = rng.standard_normal(k.shape).astype(np.float32)
    xs = rng.standard_normal((3, *x.shape)).astype(np.float32)
    compiled = jax.jit(loop).lower(kernel, xs).compile()
    labels = _conv_labels(compiled.as_text())
    assert labels and set(labels) == {"b01f_01io->b01f"}
    got = np.asarray(compiled(kernel, xs))
    for i in range(len(xs)):
        assert got[i].tobytes() == exe([kernel, xs[i]])[0].tobytes()


def test_unused_parameters_are_kept_and_checked():
    exe = hlo.compile_hlo(_hlo(lambda a, unused: a + 1, np.zeros(2, np.int32),
                               np.zeros(5, np.float32)))
    assert len(exe.parameters) == 2
    np.testing.assert_array_equal(exe([np.array([1, 2]), np.zeros(5)])[0], [2, 3])
    with pytest.raises(ComputationError, match="takes 2 parameters"):
        exe([np.array([1, 2])])
    with pytest.raises(ComputationError, match=r"parameter 1 expects float32\[5\]"):
        exe([np.array([1, 2]), np.zeros(4)])


def test_portable_artifact_round_trips_with_the_signature():
    module = _hlo(lambda a, b: (a * b, a.sum()), np.zeros(3, np.float32),
                  np.zeros(3, np.float32))
    artifact, params, results = hlo.portable_artifact(module)
    assert [str(p) for p in params] == ["float32[3]", "float32[3]"]
    assert [str(r) for r in results] == ["float32[3]", "float32[]"]
    # MLIR bytecode whose producer names the StableHLO version TF 2.14 reads.
    assert artifact.startswith(b"ML\xefR") and b"StableHLO_v0.9.0" in artifact[:32]


def test_portable_artifact_refuses_bytes_that_are_no_hlo_module():
    with pytest.raises(ComputationError, match="StableHLO"):
        hlo.portable_artifact(b"not a module")


# --- custom calls: native code outside the HLO is refused before compilation ----------

_TARGETS = st.one_of(
    st.sampled_from(["lapack_sgetrf_ffi", "lapack_ssyevd_ffi", "xla_ffi_python_cpu_callback",
                     "xla_python_cpu_callback", "__gpu$xla.gpu.triton"]),
    st.text(alphabet=string.ascii_letters + string.digits + "_.$", min_size=1,
            max_size=40).filter(
            # names starting with `$` are XLA's own: jax cannot even lower them
            lambda t: t not in hlo.XLA_OWN_TARGETS and not t.startswith("$")))


def _ffi(target: str, shape: tuple, dtype):
    def fn(x):
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(shape, dtype))(x) + 1
    return fn


@settings(max_examples=25, deadline=None, database=None)
@given(_TARGETS, st.lists(st.integers(1, 4), max_size=2).map(tuple),
       st.sampled_from([np.float32, np.int32]))
def test_any_custom_call_is_refused_before_compilation_and_at_export(target, shape, dtype):
    fn = _ffi(target, shape, dtype)
    spec = jax.ShapeDtypeStruct(shape, dtype)
    with pytest.raises(ComputationError, match="custom call") as info:
        hlo.compile_hlo(_hlo(fn, spec))
    assert f"`{target}`" in str(info.value)
    with pytest.raises(ExportError, match="custom call") as info:
        tff_xla.xla_computation(fn, spec)
    assert f"`{target}`" in str(info.value) and "test_runtime_hlo.py:" in str(info.value)


def test_linalg_and_debug_print_name_the_operation_and_its_line():
    def fn(a):
        jax.debug.print("a = {}", a)
        return jnp.linalg.solve(a, a[0]) + jnp.linalg.eigh(a)[0]

    line = fn.__code__.co_firstlineno
    with pytest.raises(ExportError) as info:
        tff_xla.xla_computation(fn, jax.ShapeDtypeStruct((3, 3), np.float32))
    text = str(info.value)
    for operation, at in (("debug_print", line + 1), ("lu", line + 2), ("eigh", line + 2)):
        assert f"`{operation}` at {__file__}:{at}" in text


# --- untrusted modules: checked, then imported by XLA in a helper process --------------

def _two_outputs(scale: float = 1.0) -> bytes:
    return _hlo(lambda a, b: (a + b * scale, a * b), np.zeros(2, np.float32),
                np.zeros(2, np.float32))


def _crasher(where: str, scale: float) -> bytes:
    """A module whose entry result lists one tuple element too many: unchecked, XLA's
    import dies on it (SIGSEGV for the root's shape, a CHECK failure for the host's)."""
    from fax_bridge.v1 import hlo_module_pb2

    module = hlo_module_pb2.Module.FromString(_two_outputs(scale))
    entry = next(c for c in module.computations if c.id == module.entry_computation_id)
    root = next(i for i in entry.instructions if i.id == entry.root_id)
    shape = root.shape if where == "root" else module.host_program_shape.result
    shape.tuple_shapes.add(element_type=11, dimensions=[2])
    return module.SerializeToString()


@pytest.mark.parametrize("where,signal", [("root", "SIGSEGV"), ("host", "SIGABRT")])
def test_xla_dying_on_a_module_is_a_named_error_and_the_caller_lives(
        monkeypatch, helpers, where, signal):
    with pytest.raises(HloModuleError, match="refused before XLA read it"):
        hlo.compile_hlo(_crasher(where, scale=0.5 + (where == "host")))
    # Past the structural checks, XLA itself dies on it: only its helper process goes.
    crasher = _crasher(where, scale=0.25 + (where == "host"))
    monkeypatch.setattr(hlo.hlo_check, "check_module", lambda module: None)
    with pytest.raises(HloModuleError) as info:
        hlo.to_stablehlo(crasher)
    text = str(info.value)
    assert f"XLA died reading the Xla computation's HloModuleProto `jit__lambda`" in text
    # How the helper dies is XLA's undefined behaviour on a bad pointer for the root's
    # shape (SIGSEGV here, once another ending in a full run); the host's is a CHECK.
    died = re.search(r"the XLA import process was (killed by (SIG[A-Z]+)|exited with "
                     r"status -?\d+)", text)
    assert died, text
    assert where == "root" or died.group(2) == signal
    assert died.group(2) != "SIGABRT" or "Check failed" in text  # XLA's reason, quoted
    with pytest.raises(HloModuleError, match="XLA died"):  # remembered, not re-run
        hlo.program_text(crasher)
    a, b = np.array([1.0, 2.0], np.float32), np.array([3.0, 4.0], np.float32)
    total, product = hlo.compile_hlo(_two_outputs(5.0 + (where == "host")))([a, b])
    np.testing.assert_allclose(product, a * b)


def test_each_module_is_imported_once_per_process(monkeypatch):
    module = _two_outputs(7.0)
    calls = []
    convert = hlo._importer.convert
    monkeypatch.setattr(hlo._importer, "convert", lambda m: calls.append(m) or convert(m))
    first = hlo.to_stablehlo(module)
    assert hlo.to_stablehlo(module) == first and hlo.program_text(module)
    hlo.compile_hlo(module)
    assert calls == [module]


def test_the_helper_process_restarts_after_idling_and_is_killed_past_its_time_limit(helpers):
    import signal as signals

    importer = hlo_import.Importer(idle_seconds=0.2)
    assert importer.convert(_two_outputs(8.0))[0]
    assert isinstance(importer._proc, forks.ForkedProcess) == (helpers == "forked")
    first = importer._proc.pid
    assert importer._proc.wait(timeout=300) == 0  # the idle helper exits by itself
    converted, payload = importer.convert(b"\x0a\x03abc\x12")  # XLA refuses it
    assert not converted and payload and importer._proc.pid != first
    # An import that hangs (its helper stopped: it never answers) ends at the limit.
    hung = hlo_import.Importer(timeout_seconds=0.5)
    hung._process().send_signal(signals.SIGSTOP)  # started and ready, then stopped
    with pytest.raises(hlo_import.Died, match="did not finish importing it within 0.5 s") as e:
        hung.convert(_two_outputs(9.5))
    assert e.value.timed_out and not e.value.crash and hung._proc is None


def test_a_helpers_start_never_counts_against_a_modules_time_limit(monkeypatch):
    """The module's time limit is counted from when the helper is ready: a start that
    took (on the clock the importer reads) longer than the whole limit still gives the
    module all of it. The clock is advanced by hand as the helper's READY byte arrives,
    so no real time decides it."""
    clock = [0.0]
    real_monotonic, real_read = time.monotonic, hlo_import._read_exact

    class Clock:
        @staticmethod
        def monotonic() -> float:
            return real_monotonic() + clock[0]

    def read_exact(fd, count, deadline):
        data = real_read(fd, count, deadline)
        if data == hlo_import.READY and count == len(hlo_import.READY):
            clock[0] += 1000.0  # the start "took" 1000 s, past the module's 600 s limit
        return data

    monkeypatch.setattr(hlo_import, "time", Clock)
    monkeypatch.setattr(hlo_import, "_read_exact", read_exact)
    monkeypatch.setattr(forks.ForkServer, "inherited", classmethod(lambda cls: None))
    importer = hlo_import.Importer(timeout_seconds=600.0, startup_seconds=3000.0)
    assert importer.convert(_two_outputs(12.0))[0]
    assert clock[0] == 1000.0
    importer._close()


def test_a_helper_that_never_becomes_ready_is_a_died_at_its_start_up_limit(monkeypatch):
    """A helper whose start hangs (stopped before it can write its READY byte, and
    never resumed) is a `Died` saying so when the start-up limit ends."""
    import os
    import signal as signals
    import subprocess

    spawn = subprocess.Popen
    stopped = []

    def stopped_start(*args, **kwargs):
        proc = spawn(*args, **kwargs)
        os.kill(proc.pid, signals.SIGSTOP)
        stopped.append(proc)
        return proc

    monkeypatch.setattr(hlo_import.subprocess, "Popen", stopped_start)
    monkeypatch.setattr(forks.ForkServer, "inherited", classmethod(lambda cls: None))
    stuck = hlo_import.Importer(startup_seconds=0.5)
    with pytest.raises(hlo_import.Died, match="did not start within 0.5 s") as e:
        stuck.convert(_two_outputs(12.0))
    assert e.value.timed_out and not e.value.crash and stuck._proc is None
    assert len(stopped) == 1 and stopped[0].poll() is not None  # killed, not left behind


def test_remembered_imports_are_bounded_in_bytes():
    verdicts = hlo._Verdicts(max_bytes=2048)
    verdicts.put("a", b"x" * 1000)
    verdicts.put("b", HloModuleError("refused"))  # counts 1 KiB
    assert verdicts.get("b") and verdicts.get("a")  # "b" is now the least recently used
    verdicts.put("c", b"y" * 1000)
    assert verdicts.get("b") is None and verdicts.get("a") and verdicts.get("c")
    verdicts.put("d", b"z" * 4096)  # larger than the bound: not kept
    assert verdicts.get("d") is None


@pytest.mark.parametrize("size", [70 << 10, 4 << 20])
def test_a_stopped_helper_cannot_hold_the_caller_past_its_time_limit(helpers, size):
    """The deadline is armed before the module is written: a helper stopped with
    SIGSTOP (it reads nothing, so a module larger than the pipe's 64 KiB would block
    the write) costs the caller its time limit, then a Died naming it."""
    import os
    import signal as signals
    import threading

    importer = hlo_import.Importer(timeout_seconds=1.0)
    assert importer.convert(_two_outputs(10.0))[0]
    os.kill(importer._proc.pid, signals.SIGSTOP)
    outcome = []

    def convert():
        try:
            importer.convert(b"\x0a" + b"x" * size)
        except hlo_import.Died as e:
            outcome.append(e)

    worker = threading.Thread(target=convert, daemon=True)
    worker.start()
    worker.join(120)  # only so that a hang fails the test instead of stalling it
    assert outcome and outcome[0].timed_out and not outcome[0].crash
    assert importer._proc is None  # the stopped helper was killed
    assert importer.convert(_two_outputs(10.0))[0]  # a fresh helper serves the next


def test_a_helper_killed_from_outside_is_retried_and_never_the_modules_verdict(
        monkeypatch, helpers):
    """SIGKILL from outside while a module is imported: the module is imported again
    in a fresh helper, and its result is the one an undisturbed import gives."""
    import os
    import signal as signals

    module = _two_outputs(11.0)
    importer = hlo_import.Importer()
    want = importer.convert(module)
    process, kills = importer._process, []

    def killed_once():  # the helper a call writes to dies as the call begins
        proc = process()
        if not kills:
            os.kill(proc.pid, signals.SIGKILL)
            while proc.poll() is None:
                time.sleep(0.01)
            kills.append(proc.pid)
        return proc

    monkeypatch.setattr(importer, "_process", killed_once)
    with pytest.raises(hlo_import.Died, match="killed by SIGKILL from outside") as info:
        importer.convert(module)
    assert not info.value.crash and not info.value.timed_out
    monkeypatch.setattr(hlo, "_importer", importer)
    kills.clear()
    assert hlo.to_stablehlo(module) == want[1] and len(kills) == 1


_SCRIPTED: list = []
_DEATHS = {"crash": lambda: hlo_import.Died("killed by SIGABRT", crash=True),
           "killed": lambda: hlo_import.Died("killed by SIGKILL from outside"),
           "timeout": lambda: hlo_import.Died("not within 1 s", timed_out=True)}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["crash", "killed", "timeout", "ok"]), min_size=1,
                max_size=6))
def test_only_xla_crashing_twice_on_a_module_is_kept_as_its_verdict(outcomes):
    """Each call of the helper dies one way or answers: calls repeat until one gives a
    result; a verdict is kept (the helper never asked again) only when XLA crashed on
    the module in two helpers in a row, never for a kill from outside or the time
    limit."""
    _SCRIPTED.append(None)
    module = _two_outputs(100.0 + len(_SCRIPTED))  # a module of its own: no verdict yet
    real = hlo._importer.convert(module)
    left = list(outcomes)

    def scripted(m):
        what = left.pop(0) if left else "ok"
        if what == "ok":
            return real
        raise _DEATHS[what]()

    original = hlo._importer
    fake = type("Fake", (), {"convert": staticmethod(scripted)})()
    hlo._importer = fake
    try:
        for _ in range(len(outcomes) + 1):
            before = list(left)
            try:
                assert hlo.to_stablehlo(module) == real[1]
                break
            except HloModuleError as e:
                used = before[:len(before) - len(left)]
                if used == ["crash", "crash"]:
                    assert "in two helper processes" in str(e)
                    with pytest.raises(HloModuleError, match="two helper"):
                        hlo.to_stablehlo(module)  # kept: the helper is not asked again
                    assert left == before[2:]
                    break
                assert "cut short" in str(e) and "not judged" in str(e)
        else:
            raise AssertionError(f"no result after {outcomes}")
    finally:
        hlo._importer = original
