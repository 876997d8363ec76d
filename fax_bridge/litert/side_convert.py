"""StableHLO -> LiteRT flatbuffer, run as a script in the converter's side environment.

litert-converter (0.5.0) cannot share the main environment with Flower (its xdsl pins
typing-extensions below what Flower's HTTP stack needs), so it lives in `.venv-litert`
(`tools/litert/setup.sh`) and this file runs there by path, importing only the
converter and the standard library:

  python side_convert.py MODULE.mlirbc OUT.tflite SPEC.json

SPEC.json: {"signature": name, "inputs": [names], "outputs": [names]}. The module's
`main` becomes the model's one signature with those tensor names. Before the converter's
own passes, `stablehlo.optimization_barrier`s (which only order XLA's fusion) are
dropped; after them, each `tfl.while` has its condition and body outlined into functions
(what the flatbuffer writer needs, and the pass that does it in TensorFlow's converter is
not in this package), values a loop reads from outside it passed as loop operands,
constants copied in. Prints one JSON object: {"ok": true} or {"ok": false, "stage":
"convert" | "export", "error": text, "ops": [MLIR op names left unconverted]}.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import pathlib
import re
import sys

_CONSTANTS = {"arith.constant", "tfl.pseudo_const", "tfl.no_value", "stablehlo.constant",
              "tfl.pseudo_qconst"}


def _walk(op, out: list) -> list:
    """Every operation nested in `op`, children before their parent (`side_rewrites`)."""
    return _rewrites().walk(op, out)


def _inside(value, loop) -> bool:
    """Whether `value` is defined within `loop`'s regions."""
    owner = value.owner
    op = owner.owner if not hasattr(owner, "regions") else owner  # a block's parent op
    op = getattr(op, "operation", op)
    while op is not None:
        if op == loop:
            return True
        op = op.parent
        op = getattr(op, "operation", op) if op is not None else None
    return False


def _drop_barriers(module) -> None:
    for op in _walk(module.operation, []):
        if op.name == "stablehlo.optimization_barrier":
            for result, operand in zip(op.results, op.operands):
                result.replace_all_uses_with(operand)
            op.erase()


def _outline(module, ir, func) -> None:
    """Each `tfl.while`'s regions as private functions called from one-op regions."""
    loops = [op for op in _walk(module.operation, []) if op.name == "tfl.while"]
    for number, loop in enumerate(loops):
        inner = _walk(loop, [])[:-1]
        captured, constants = [], []
        for op in inner:
            for value in op.operands:
                if _inside(value, loop):
                    continue
                source = value.owner
                source = getattr(source, "operation", source)
                is_const = hasattr(source, "regions") and source.name in _CONSTANTS
                bucket = constants if is_const else captured
                if all(value != v for v in bucket):
                    bucket.append(value)
        carried = [v.type for v in loop.operands]
        types = carried + [v.type for v in captured]
        names = []
        for index, region in enumerate(loop.regions):
            block = region.blocks[0]
            terminator = list(block.operations)[-1]
            outs = [v.type for v in terminator.operands]
            if index == 1:
                outs = outs + [v.type for v in captured]
            name = f"__fax_while_{number}_{'cond' if index == 0 else 'body'}"
            with ir.InsertionPoint(module.body):
                fn = func.FuncOp(name, (types, outs), visibility="private")
            entry = fn.add_entry_block()
            for old, new in zip(block.arguments, entry.arguments):
                old.replace_all_uses_with(new)
            copies = []
            with ir.InsertionPoint(entry):
                for value in constants:
                    copies.append(value.owner.operation.clone())
            for op in list(block.operations):
                entry.append(op.operation)
            extra = entry.arguments[len(carried):]
            swaps = list(zip(captured, extra)) + [(v, c.results[0]) for v, c in
                                                 zip(constants, copies)]
            for op in _walk(fn.operation, []):
                for i, value in enumerate(op.operands):
                    for old, new in swaps:
                        if value == old:
                            op.operands[i] = new
            last = list(entry.operations)[-1]
            with ir.InsertionPoint(last):
                func.ReturnOp(list(last.operands) + (list(extra) if index == 1 else []))
            last.erase()
            names.append((name, outs))
        attributes = {name: loop.attributes[name] for name in loop.attributes}
        with ir.InsertionPoint(loop):
            new = ir.Operation.create("tfl.while", results=types,
                                      operands=list(loop.operands) + captured,
                                      attributes=attributes, regions=2)
        for region, (name, outs) in zip(new.regions, names):
            block = region.blocks.append(*types)
            with ir.InsertionPoint(block):
                call = func.CallOp(outs, ir.FlatSymbolRefAttr.get(name), list(block.arguments))
                ir.Operation.create("tfl.yield", operands=list(call.results))
        for old, result in zip(loop.results, new.results):
            old.replace_all_uses_with(result)
        loop.erase()


@functools.lru_cache(maxsize=None)
def _rewrites():
    """`side_rewrites.py` beside this file (run with -P, its folder is not on the path),
    loaded once."""
    path = pathlib.Path(__file__).resolve().with_name("side_rewrites.py")
    spec = importlib.util.spec_from_file_location("fax_litert_side_rewrites", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _unconverted(text: str) -> list:
    """The StableHLO operations the converter's message names."""
    return sorted(set(re.findall(r"'((?:stablehlo|chlo|mhlo|vhlo|tfl)\.[a-z_0-9]+)'", text)))


def main(argv: list) -> int:
    module_path, out_path, spec_path = argv
    import litert_converter.converter_api_ext as api
    from litert_converter.mlir import ir, passmanager
    from litert_converter.mlir.dialects import func

    with open(spec_path) as f:
        spec = json.load(f)
    context = ir.Context()
    api.prepare_mlir_context(context)
    with context, ir.Location.unknown():
        with open(module_path, "rb") as f:
            module = ir.Module.parse(f.read())
        _drop_barriers(module)
        _rewrites().select_and_scatter(module, ir)
        _rewrites().batch_grouped_convolutions(module, ir)
        _rewrites().lhs_dilated_convolutions(module, ir)
        try:
            api.run_convert_to_tfl_passes(module, passmanager.PassManager(),
                                          api.ConvertToTFLConfig())
        except Exception as e:
            print(json.dumps({"ok": False, "stage": "convert", "error": str(e)[-4000:],
                              "ops": _unconverted(str(e))}))
            return 0
        left = sorted({op.name for op in _walk(module.operation, [])
                       if op.name.split(".")[0] in ("stablehlo", "chlo", "mhlo", "tf", "vhlo")
                       and not op.name.startswith("tfl.")})
        _outline(module, ir, func)
        api.set_signature(module.operation, spec["signature"], spec["inputs"],
                          spec["outputs"])
        try:
            data = api.export_flatbuffer_to_bytes(module.operation)
        except Exception as e:
            print(json.dumps({"ok": False, "stage": "export", "error": str(e)[-4000:],
                              "ops": left}))
            return 0
    with open(out_path, "wb") as f:
        f.write(data)
    print(json.dumps({"ok": True, "bytes": len(data), "ops": left}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
