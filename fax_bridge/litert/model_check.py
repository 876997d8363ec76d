"""A LiteRT model checked against the round before any client runs it.

A model that was not converted here (one carried with an app, one read back from the
disk cache) is believed only once `check(model, signature, inputs, outputs, where)`
holds: its bytes parse as a LiteRT flatbuffer (a cut or zeroed file is refused, not left
to fail every round with the interpreter's "unpack_from"), it uses LiteRT's builtin ops
only (a custom or Flex op is refused by name), it has the signature `signature`, and
that signature's tensors are exactly the round's client part's, name by name (in any
order: the flatbuffer lists them sorted as text, the runner feeds them by name), each with
its shape and dtype as the flatbuffer declares them (not as a manifest beside it says).
`prepares` then has the interpreter allocate it. Each refusal is a `ModelRefused` naming
`where` (the file), the mismatch and the fix.
"""

from __future__ import annotations

from ai_edge_litert import schema_py_generated as schema

from fax_bridge.errors import ComputationError
from fax_bridge.litert import flatbuffer

_TYPES = {v: k.lower() for k, v in vars(schema.TensorType).items() if not k.startswith("_")}
IDENTIFIER = b"TFL3"  # a LiteRT flatbuffer's file identifier, at bytes 4..8


class ModelRefused(ComputationError):
    """A model that is not the one the round's client part needs (module docstring)."""


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _tensors(maps, tensors) -> tuple:
    out = []
    for entry in maps or []:
        tensor = tensors[entry.tensorIndex]
        shape = () if tensor.shape is None else tuple(int(d) for d in tensor.shape)
        out.append((_text(entry.name), shape, _TYPES.get(tensor.type, f"type {tensor.type}")))
    return tuple(out)


def declared(model: bytes, signature: str, where: str, fix: str) -> tuple:
    """(inputs, outputs) of `signature` as the flatbuffer declares them: tuples of
    (name, shape, dtype name), in the signature's order; refuses a model that does not
    parse or lacks the signature."""
    if len(model) < 8 or model[4:8] != IDENTIFIER:
        raise ModelRefused(f"{where} is not a LiteRT model (its {len(model)} bytes do not "
                           f"carry the flatbuffer identifier {IDENTIFIER!r}: cut, zeroed "
                           f"or another file); {fix}")
    try:
        tree = flatbuffer.read(model)
        found = {}
        for sig in tree.signatureDefs or []:
            tensors = tree.subgraphs[sig.subgraphIndex].tensors
            found[_text(sig.signatureKey)] = (_tensors(sig.inputs, tensors),
                                              _tensors(sig.outputs, tensors))
    except Exception as e:  # noqa: BLE001 - any failure to parse the model's bytes
        # (struct.error "unpack_from", IndexError, UnicodeError, ... for damaged bytes)
        raise ModelRefused(f"{where} cannot be read as a LiteRT model "
                           f"({type(e).__name__}: {e}): it is cut or damaged; {fix}") from None
    if signature not in found:
        raise ModelRefused(f"{where} has no signature {signature!r} (it has "
                           f"{sorted(found)}); {fix}")
    return found[signature]


def check(model: bytes, signature: str, inputs: tuple, outputs: tuple, where: str,
          fix: str) -> list:
    """Refuses `model` (module docstring) unless its signature `signature` has exactly
    the tensors `inputs` and `outputs` (`lowering.Tensor`s; matched by name, in any
    order) and its ops are builtins; returns the operators it uses."""
    have = declared(model, signature, where, fix)
    for role, want, got in (("input", inputs, have[0]), ("output", outputs, have[1])):
        # by name: the runner feeds and reads tensors by name, and a flatbuffer's
        # signature lists them sorted as text (`x/10` before `x/2`), not in the round's
        # order
        wanted = {t.name: (tuple(t.shape), t.dtype) for t in want}
        names = [n for n, _, _ in got]
        if sorted(names) != sorted(wanted) or len(set(names)) != len(names):
            extra = [n for n in names if n not in wanted]
            missing = [n for n in wanted if n not in names]
            raise ModelRefused(
                f"{where}: signature {signature!r} has {role}s {names[:8]}, but the "
                f"round's client part has {list(wanted)[:8]} (the model's "
                f"{extra[:4] or 'repeated names'} are not the round's; the round's "
                f"{missing[:4] or 'none'} are missing); {fix}")
        for name, shape, dtype in got:
            w_shape, w_dtype = wanted[name]
            if (shape, dtype) != (w_shape, w_dtype):
                raise ModelRefused(
                    f"{where}: {role} {name} is {dtype}{list(shape)} in the model, but the "
                    f"round's client part needs {w_dtype}{list(w_shape)}; {fix}")
    try:
        names = flatbuffer.operators(model)
    except Exception as e:  # noqa: BLE001 - as in `declared`
        raise ModelRefused(f"{where} cannot be read as a LiteRT model "
                           f"({type(e).__name__}: {e}): it is cut or damaged; {fix}") from None
    foreign = flatbuffer.non_builtin(names)
    if foreign:
        raise ModelRefused(f"{where} uses ops outside LiteRT's builtins ({', '.join(foreign)}), "
                           f"which a stock LiteRT runtime does not have; {fix}")
    return names


def prepares(model: bytes, where: str, fix: str) -> None:
    """Refuses a model the LiteRT interpreter will not prepare, naming `where`."""
    from ai_edge_litert.interpreter import Interpreter

    try:
        Interpreter(model_content=model, num_threads=1).allocate_tensors()
    except (RuntimeError, ValueError) as e:
        raise ModelRefused(f"{where} is refused by the LiteRT interpreter ({e}); {fix}") \
            from None
