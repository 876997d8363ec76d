"""Tests of fax_bridge.runtime.local_backend: the in-process ClientsBackend."""

import federated_language as fl
import numpy as np
import pytest
from federated_language.common_libs import structure

from fax_bridge.errors import ComputationError
from fax_bridge.runtime.local_backend import LocalClientsBackend
from fax_bridge.tff.xla import typed_xla_computation

F32 = np.float32
V2 = fl.TensorType(F32, [2])


def test_put_map_zip_aggregate_get():
    backend = LocalClientsBackend()
    xs = [np.array([i, -i], F32) for i in range(4)]
    x = backend.put(V2, xs)
    s = backend.broadcast(fl.TensorType(F32), np.float32(3.0), 4)
    assert x.num_clients == 4 and s.num_clients == 4
    pair = fl.StructType([(None, V2), (None, F32)])
    zipped = backend.zip([x, s], [None, None])
    assert zipped.type_signature == pair
    fn = typed_xla_computation(lambda v, a: v * a, pair)
    mapped = backend.map(fn, fl.Type.from_proto(fn.type), zipped)
    assert mapped.type_signature == V2
    np.testing.assert_allclose(backend.get(mapped), [v * 3 for v in xs])
    np.testing.assert_allclose(backend.aggregate(mapped, "sum"), np.sum(xs, 0) * 3)
    np.testing.assert_allclose(backend.aggregate(x, "weighted_mean", weights=s),
                               np.mean(xs, 0))
    backend.close()


def test_zip_keeps_names_and_checks_sizes():
    backend = LocalClientsBackend()
    a = backend.put(fl.TensorType(F32), [np.float32(1), np.float32(2)])
    b = backend.put(fl.TensorType(np.int32), [np.int32(5), np.int32(6)])
    z = backend.get(backend.zip([a, b], ["a", "b"]))
    assert structure.name_list(z[1]) == ["a", "b"] and z[1].b == 6
    c = backend.put(fl.TensorType(F32), [np.float32(1)])
    with pytest.raises(ComputationError, match="different numbers of clients"):
        backend.zip([a, c], [None, None])
