"""Mutation fuzzing of the HLO modules inside exported computations, crash-proof.

Every case takes one Xla part of an exported computation, changes one class of its
HloModuleProto bytes (`CLASSES`: shapes, layouts, tuple lengths, opcodes, operand and
computation ids, parameter numbers, root and entry ids, program shapes, varint lengths,
random bytes) and runs it through a real entry point (`TARGETS`):

- `run`: `interpreter.interpret` of the whole computation holding the mutated part;
- `load`: a device's `Load` RPC handler, in process, with the mutated Xla computation;
- `convert`: jax's bare HLO -> StableHLO import, to measure what XLA does unprotected.

Cases run in a worker process, one after another; a worker that dies (a signal, or
silence past the per-case timeout) is a crash (or hang) of the case it had started, and
a fresh worker goes on with the next case. Case `i` of seed `s` is the same on every
run (`case(s, i)`), so a crash is reproduced with `--seed s --start i --cases 1`.

    python tools/hlo_fuzz.py --target run --cases 2000 --seed 0
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import pathlib
import random
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
CLASSES = ("element_type", "dimensions", "layout", "tuple_length", "opcode",
           "operand_ids", "called_ids", "parameter_number", "root_id", "entry_id",
           "program_shape", "varint_length", "random_bytes")
TARGETS = ("run", "load", "convert")
_OPCODES = ("add", "parameter", "tuple", "get-tuple-element", "constant", "broadcast",
            "reduce", "dot", "while", "call", "fusion", "custom-call", "reshape",
            "transpose", "slice", "concatenate", "after-all", "infeed", "sort",
            "conditional", "", "no-such-op", "ADD")


# ---------------------------------------------------------------------------------------
# Seeds: exported computations, their arguments and their Xla parts.

@functools.lru_cache(maxsize=1)
def seeds() -> list[tuple[bytes, tuple]]:
    """(serialized computation, arguments for run_computation) of each seed."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "tests"))
    import sample_computations as sc

    return [
        (sc.scaled_aggregate((3,), "sum").SerializeToString(),
         (np.ones((3, 3), np.float32), np.ones(3, np.float32))),
        (sc.scaled_aggregate((2,), "max").SerializeToString(),
         (np.ones((3, 2), np.float32), np.ones(2, np.float32))),
        (sc.linear_regression_step(features=2, examples=3).SerializeToString(),
         (np.zeros(2, np.float32), np.ones((3, 3, 2), np.float32),
          np.ones((3, 3), np.float32))),
    ]


def save_seeds(path: pathlib.Path) -> None:
    """The seeds in an npz file, so that workers need not export them again."""
    import numpy as np

    arrays = {}
    for i, (computation, args) in enumerate(seeds()):
        arrays[f"{i}.computation"] = np.frombuffer(computation, np.uint8)
        arrays.update({f"{i}.arg{j}": a for j, a in enumerate(args)})
    np.savez(path, **arrays)


def load_seeds(path: str) -> list[tuple[bytes, tuple]]:
    import numpy as np

    with np.load(path, allow_pickle=False) as npz:
        count = sum(1 for k in npz.files if k.endswith(".computation"))
        return [(npz[f"{i}.computation"].tobytes(),
                 tuple(npz[f"{i}.arg{j}"] for j in range(sum(
                     1 for k in npz.files if k.startswith(f"{i}.arg")))))
                for i in range(count)]


def xla_parts(proto) -> list:
    """Every `Xla` Computation message inside `proto`, depth first."""
    from federated_language.proto import computation_pb2

    found = []

    def visit(message):
        if isinstance(message, computation_pb2.Computation) and message.HasField("xla"):
            found.append(message)
            return
        for field, value in message.ListFields():
            if field.message_type is None:
                continue
            for item in (value if field.is_repeated else [value]):
                visit(item)

    visit(proto)
    return found


# ---------------------------------------------------------------------------------------
# Mutations.

def _shapes(module) -> list:
    """Every Shape message of a parsed module (instructions, program shapes, nested)."""
    out = []

    def add(shape):
        out.append(shape)
        for t in shape.tuple_shapes:
            add(t)
        if shape.layout.HasField("physical_shape"):
            add(shape.layout.physical_shape)

    for program in [module.host_program_shape] + [c.program_shape for c in module.computations]:
        for p in program.parameters:
            add(p)
        add(program.result)
    for comp in module.computations:
        for ins in comp.instructions:
            add(ins.shape)
    return out


def _copy(shape):
    """A detached copy: copying a message into its own descendant crashes protobuf."""
    return type(shape).FromString(shape.SerializeToString())


def _odd_int(rng: random.Random, near: int = 0) -> int:
    return rng.choice([-1, -(1 << 62), 0, 1, near + 1, near - 1, near + 2, 1 << 31,
                       (1 << 32) + near, (1 << 63) - 1, rng.randrange(-50, 50)])


def _mutate_structured(module, cls: str, rng: random.Random) -> bool:
    """Changes one field of class `cls` in a parsed module; False when it has none."""
    comps = list(module.computations)
    instructions = [i for c in comps for i in c.instructions]
    shapes = _shapes(module)
    if cls == "element_type":
        s = rng.choice(shapes)
        s.element_type = rng.choice([0, 13, 14, 17, 26, 99, -1, 1 << 20, 1, 4, 11, 16, 32])
    elif cls == "dimensions":
        s = rng.choice(shapes)
        if s.dimensions and rng.random() < 0.7:
            k = rng.randrange(len(s.dimensions))
            s.dimensions[k] = _odd_int(rng, s.dimensions[k])
        elif s.dimensions and rng.random() < 0.5:
            del s.dimensions[rng.randrange(len(s.dimensions))]
        else:
            s.dimensions.append(rng.choice([0, 1, 3, -1]))
    elif cls == "layout":
        s = rng.choice([s for s in shapes if s.HasField("layout")] or shapes)
        m2m = s.layout.minor_to_major
        r = rng.random()
        if m2m and r < 0.3:
            m2m[rng.randrange(len(m2m))] = _odd_int(rng, len(m2m))
        elif len(m2m) > 1 and r < 0.5:
            m2m[0] = m2m[-1]
        elif m2m and r < 0.65:
            del m2m[rng.randrange(len(m2m))]
        elif r < 0.8:
            m2m.append(rng.choice([len(m2m), 0, -1]))
        elif r < 0.9:
            s.layout.tiles.add().dimensions.extend([rng.choice([0, -1, 2, 8, 1 << 40])])
        else:
            s.layout.element_size_in_bits = rng.choice([-1, 3, 1 << 40])
    elif cls == "tuple_length":
        tuples = [s for s in shapes if s.element_type == 13 or s.tuple_shapes]
        s = rng.choice(tuples or shapes)
        r = rng.random()
        if s.tuple_shapes and r < 0.4:
            del s.tuple_shapes[rng.randrange(len(s.tuple_shapes))]
        elif r < 0.8:
            extra = s.tuple_shapes.add()
            extra.element_type = rng.choice([11, 13, 4])
            extra.dimensions.extend(rng.choice([[], [2], [3, 1]]))
        else:
            other = _copy(rng.choice(shapes))
            s.element_type = 13
            s.tuple_shapes.add().CopyFrom(other)
    elif cls == "opcode":
        ins = rng.choice(instructions)
        ins.opcode = rng.choice(_OPCODES + tuple({i.opcode for i in instructions}))
    elif cls == "operand_ids":
        ins = rng.choice(instructions)
        ids = [i.id for i in instructions]
        r = rng.random()
        if ins.operand_ids and r < 0.5:
            k = rng.randrange(len(ins.operand_ids))
            ins.operand_ids[k] = rng.choice(ids + [_odd_int(rng, ins.operand_ids[k])])
        elif ins.operand_ids and r < 0.7:
            del ins.operand_ids[rng.randrange(len(ins.operand_ids))]
        elif r < 0.85:
            ins.operand_ids.append(rng.choice(ids + [-1, 1 << 40]))
        else:
            ins.control_predecessor_ids.append(rng.choice(ids + [-1, ins.id]))
    elif cls == "called_ids":
        ins = rng.choice([i for i in instructions if i.called_computation_ids] or instructions)
        cids = [c.id for c in comps]
        if ins.called_computation_ids and rng.random() < 0.6:
            k = rng.randrange(len(ins.called_computation_ids))
            ins.called_computation_ids[k] = rng.choice(cids + [_odd_int(rng)])
        elif ins.called_computation_ids and rng.random() < 0.5:
            del ins.called_computation_ids[0]
        else:
            ins.called_computation_ids.append(rng.choice(cids + [-1, 99]))
    elif cls == "parameter_number":
        params = [i for i in instructions if i.opcode == "parameter"] or instructions
        ins = rng.choice(params)
        ins.parameter_number = _odd_int(rng, ins.parameter_number)
    elif cls == "root_id":
        comp = rng.choice(comps)
        comp.root_id = rng.choice([i.id for i in instructions] + [_odd_int(rng, comp.root_id)])
    elif cls == "entry_id":
        r = rng.random()
        if r < 0.5:
            module.entry_computation_id = rng.choice(
                [c.id for c in comps] + [_odd_int(rng, module.entry_computation_id)])
        elif r < 0.75:
            rng.choice(comps).id = rng.choice([c.id for c in comps] + [_odd_int(rng)])
        else:
            del module.computations[rng.randrange(len(comps))]
    elif cls == "program_shape":
        program = rng.choice([module.host_program_shape] + [c.program_shape for c in comps])
        r = rng.random()
        if program.parameters and r < 0.4:
            del program.parameters[rng.randrange(len(program.parameters))]
        elif r < 0.7:
            program.parameters.add().CopyFrom(_copy(rng.choice(shapes)))
        elif r < 0.85:
            program.result.CopyFrom(_copy(rng.choice(shapes)))
        else:
            program.parameter_names.append("extra")
    else:
        return False
    return True


def _length_prefixes(data: bytes, start: int = 0, end: Optional[int] = None,
                     depth: int = 0) -> list[tuple[int, int]]:
    """(offset, byte count) of the varint length of every length-delimited field that
    the wire format reaches, recursing into those that parse as messages."""
    end = len(data) if end is None else end
    found = []
    pos = start

    def varint(at):
        value, shift = 0, 0
        while at < end and shift < 70:
            b = data[at]
            value |= (b & 0x7F) << shift
            at += 1
            shift += 7
            if not b & 0x80:
                return value, at
        raise ValueError("truncated varint")

    try:
        while pos < end:
            key, pos = varint(pos)
            wire = key & 7
            if wire == 0:
                _, pos = varint(pos)
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            elif wire == 2:
                at = pos
                length, pos = varint(pos)
                if pos + length > end:
                    raise ValueError("length past the end")
                found.append((at, pos - at))
                if depth < 12:
                    found.extend(_length_prefixes(data, pos, pos + length, depth + 1))
                pos += length
            else:
                raise ValueError("not a message")
    except ValueError:
        if depth:
            return []  # bytes or a string, not a message
    return found


def _mutate_bytes(data: bytes, cls: str, rng: random.Random) -> bytes:
    out = bytearray(data)
    if cls == "varint_length":
        prefixes = _length_prefixes(data)
        at, size = rng.choice(prefixes)
        last = at + size - 1  # change the low 7 bits of the varint's last byte
        old = out[last] & 0x7F
        new = rng.choice([0, 1, old + 1, old - 1, old + 2, old - 2, 0x7F, rng.randrange(128)])
        out[last] = (out[last] & 0x80) | (new % 128)
        return bytes(out)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(max(1, len(out)))
        op = rng.choice(["flip", "set", "cut", "insert", "duplicate"])
        if op == "flip" and out:
            out[at] ^= 1 << rng.randrange(8)
        elif op == "set" and out:
            out[at] = rng.randrange(256)
        elif op == "cut":
            del out[at:at + rng.randint(1, 32)]
        elif op == "insert":
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        else:
            out[at:at] = out[at:at + rng.randint(1, 32)]
    return bytes(out)


def mutate(module: bytes, cls: str, rng: random.Random) -> bytes:
    """`module` (serialized HloModuleProto) with one change of class `cls`."""
    if cls in ("varint_length", "random_bytes"):
        return _mutate_bytes(module, cls, rng)
    from fax_bridge.v1 import hlo_module_pb2

    parsed = hlo_module_pb2.Module.FromString(module)
    _mutate_structured(parsed, cls, rng)
    return parsed.SerializeToString()


@dataclasses.dataclass
class Case:
    index: int
    cls: str
    computation: bytes  # the whole computation with the mutated part
    part: bytes  # the mutated Xla Computation alone
    module: bytes  # the mutated HloModuleProto
    args: tuple


def case(seed: int, index: int, seed_list=None) -> Case:
    """Case `index` of the run with `seed` (the same on every run)."""
    from federated_language.proto import computation_pb2

    rng = random.Random(seed * 1_000_003 + index)
    cls = CLASSES[index % len(CLASSES)]
    computation, args = rng.choice(seed_list if seed_list is not None else seeds())
    proto = computation_pb2.Computation.FromString(computation)
    part = rng.choice(xla_parts(proto))
    module = mutate(part.xla.hlo_module.value, cls, rng)
    part.xla.hlo_module.value = module
    return Case(index, cls, proto.SerializeToString(), part.SerializeToString(), module,
                args)


# ---------------------------------------------------------------------------------------
# The worker: runs cases and says what each one did.

class Aborted(Exception):
    def __init__(self, code, details):
        super().__init__(f"{code}: {details}")
        self.code = code


class Context:
    """The parts of a gRPC servicer context that `Load` uses."""

    def abort(self, code, details):
        raise Aborted(code, details)

    def is_active(self):
        return True

    def invocation_metadata(self):
        return ()


def _kind(message: str) -> str:
    """Which layer refused a case, from its error message."""
    if "XLA died" in message:
        return "contained"  # XLA crashed in the helper process; the caller lived on
    if "XLA cannot read" in message:
        return "xla-refused"
    if "refused before XLA read it" in message or "not a serialized xla.HloModuleProto" in (
            message):
        return "checked"
    return "refused"  # a later check: bindings, signatures, compilation, execution


def _runner(target: str):
    if target == "run":
        from fax_bridge.errors import FaxBridgeError
        from fax_bridge.runtime import interpreter
        from fax_bridge.runtime.local_backend import LocalClientsBackend

        def run(c: Case) -> str:
            try:
                interpreter.interpret(c.computation, *c.args,
                                            backend=LocalClientsBackend())
            except FaxBridgeError as e:
                return f"{_kind(str(e))} {type(e).__name__}"
            return "ran"
        return run
    if target == "load":
        import hashlib

        import grpc

        from fax_bridge.fleet import device
        from fax_bridge.v1 import device_pb2

        servicer = device.DeviceServicer("fuzz")
        fine = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}

        def load(c: Case) -> str:
            request = device_pb2.LoadRequest(
                computation_hash=hashlib.sha256(c.part).hexdigest(), computation=c.part)
            try:
                servicer.Load(request, Context())
            except Aborted as e:
                return f"{_kind(str(e))} {e.code.name}" if e.code in fine else (
                    f"unexpected {e}")
            return "ran"
        return load
    from jax._src.lib import _jax

    def convert(c: Case) -> str:
        try:
            _jax.mlir.hlo_to_stablehlo(c.module)
        except Exception as e:
            return f"refused {type(e).__name__}"
        return "ran"
    return convert


def worker(target: str, seed: int, start: int, stop: int,
           seed_file: Optional[str] = None) -> None:
    """Runs cases start..stop-1, printing `start i` before and `done i OUTCOME` after."""
    run = _runner(target)
    seed_list = load_seeds(seed_file) if seed_file else seeds()
    for i in range(start, stop):
        c = case(seed, i, seed_list)
        print(f"start {i}", flush=True)
        try:
            outcome = run(c)
        except Exception as e:  # a bug: not our error class, though not a crash
            outcome = f"unexpected {type(e).__name__}: {str(e)[:200]}"
        print(f"done {i} {outcome}".replace("\n", " "), flush=True)


# ---------------------------------------------------------------------------------------
# The driver: workers in child processes, crashes and hangs counted per class.

@dataclasses.dataclass
class Report:
    target: str
    seed: int
    tried: int = 0
    outcomes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    by_class: dict = dataclasses.field(default_factory=dict)
    crashes: list = dataclasses.field(default_factory=list)  # (index, class, how)
    unexpected: list = dataclasses.field(default_factory=list)  # (index, class, what)
    seconds: float = 0.0

    def summary(self) -> str:
        lines = [f"{self.target}, seed {self.seed}: {self.tried} mutations, "
                 f"{len(self.crashes)} crashes, {len(self.unexpected)} unexpected errors, "
                 f"{self.seconds:.0f} s"]
        for cls in CLASSES:
            counts = self.by_class.get(cls)
            if counts:
                lines.append(f"  {cls:17} " + ", ".join(
                    f"{k} {v}" for k, v in sorted(counts.items())))
        lines += [f"  CRASH case {i} ({cls}): {how}" for i, cls, how in self.crashes]
        lines += [f"  UNEXPECTED case {i} ({cls}): {what}" for i, cls, what in self.unexpected]
        return "\n".join(lines)


def run(target: str, cases: int, seed: int = 0, start: int = 0,
        case_timeout: float = 120.0) -> Report:
    """Runs cases start..start+cases-1 against `target` in worker processes."""
    report = Report(target, seed)
    began = time.monotonic()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"), TF_CPP_MIN_LOG_LEVEL="3")
    stop = start + cases
    nxt = start
    folder = tempfile.TemporaryDirectory()
    seed_file = os.path.join(folder.name, "seeds.npz")
    save_seeds(seed_file)
    while nxt < stop:
        proc = subprocess.Popen(
            [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", target,
             "--seed", str(seed), "--start", str(nxt), "--cases", str(stop - nxt),
             "--seeds", seed_file],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
        started: Optional[int] = None
        buffer = b""
        deadline = time.monotonic() + case_timeout + 60  # the worker's imports first
        hung = False
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    word, index, *rest = line.decode().split(" ", 2)
                    index = int(index)
                    if word == "start":
                        started = index
                        deadline = time.monotonic() + case_timeout
                        continue
                    started, nxt = None, index + 1
                    cls = CLASSES[index % len(CLASSES)]
                    outcome = rest[0] if rest else ""
                    kind = outcome.split(" ", 1)[0]
                    report.tried += 1
                    report.by_class.setdefault(cls, collections.Counter())[kind] += 1
                    if kind == "unexpected":
                        report.unexpected.append((index, cls, outcome[11:]))
            elif time.monotonic() > deadline:
                hung = True
                proc.kill()
                break
        code = proc.wait()
        if started is None:
            if hung or code != 0:
                raise RuntimeError(f"the fuzz worker failed outside a case (exit {code})")
            break
        cls = CLASSES[started % len(CLASSES)]
        how = "hang" if hung else (f"killed by {signal.Signals(-code).name}" if code < 0
                                   else f"exited with status {code}")
        report.tried += 1
        report.by_class.setdefault(cls, collections.Counter())[
            "hang" if hung else "crash"] += 1
        report.crashes.append((started, cls, how))
        nxt = started + 1
    folder.cleanup()
    report.seconds = time.monotonic() - began
    return report


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=TARGETS, action="append",
                        help="entry point(s) to fuzz (default: run and load)")
    parser.add_argument("--cases", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--case-timeout", type=float, default=120.0)
    parser.add_argument("--worker", choices=TARGETS, help=argparse.SUPPRESS)
    parser.add_argument("--seeds", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.seed, args.start, args.start + args.cases, args.seeds)
        return 0
    failed = False
    for target in args.target or ["run", "load"]:
        report = run(target, args.cases, args.seed, args.start, args.case_timeout)
        print(report.summary(), flush=True)
        failed |= bool(report.crashes or report.unexpected)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
