"""Runs every TFF-0.87-authored computation in tests/data/tff087/ through the interpreter
and compares with the expected npz (same keys, dtypes and values)."""

import json
import pathlib

import numpy as np
import pytest
from federated_language.proto import computation_pb2

from fax_bridge.runtime import interpreter, npz_keys, values

DATA = pathlib.Path(__file__).resolve().parent / "data" / "tff087"
NAMES = sorted(p.stem for p in DATA.glob("*.pb"))


@pytest.mark.skipif(not NAMES, reason="no TFF 0.87 test computations in tests/data/tff087")
@pytest.mark.parametrize("name", NAMES)
def test_tff087_computation_matches_expected(name):
    proto = computation_pb2.Computation.FromString((DATA / f"{name}.pb").read_bytes())
    meta = json.loads((DATA / f"{name}.json").read_text())
    fn_type = interpreter.computation_type(proto)
    assert str(fn_type) == meta["type_signature"]
    with np.load(DATA / f"{name}.inputs.npz") as f:
        inputs = dict(f)
    with np.load(DATA / f"{name}.expected.npz") as f:
        expected = dict(f)
    arg = npz_keys.args_from_npz(inputs, fn_type.parameter)
    result = interpreter.evaluate(proto, arg, num_clients=meta["clients"])
    got = npz_keys.result_to_npz(result, fn_type.result)
    assert sorted(got) == sorted(expected)
    for key, want in expected.items():
        assert got[key].dtype == want.dtype, key
        np.testing.assert_allclose(got[key], want, rtol=1e-6, atol=1e-6, err_msg=key)
