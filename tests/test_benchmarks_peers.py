"""Smoke tests of the peer benchmarks in benchmarks/peers/.

The workload checks (split, batches, cohorts, initial weights, numpy reference) need
only numpy and scikit-learn and always run. Each peer then runs for one round through
``run_peer`` (marked ``peers``: ``make test-peers`` builds the peers' venvs with
``benchmarks/peers/setup_venvs.sh`` and runs these with ``--peers``).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

PEERS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "benchmarks", "peers")
sys.path.insert(0, PEERS_DIR)

import numpy_mlp  # noqa: E402
import run_peer  # noqa: E402
import workload  # noqa: E402


@pytest.fixture(scope="module")
def split() -> workload.Split:
    return workload.load_split()


def test_split_is_deterministic_and_partitions_the_training_set(split: workload.Split) -> None:
    again = workload.load_split()
    assert len(split.y_test) == 359 and len(split.y_train) == 1438
    assert split.x_train.shape == (1438, 64) and split.x_train.dtype == np.float32
    assert 0.0 <= split.x_train.min() and split.x_train.max() <= 1.0
    np.testing.assert_array_equal(split.x_test, again.x_test)
    assert len(split.client_indices) == workload.NUM_CLIENTS
    for a, b in zip(split.client_indices, again.client_indices):
        np.testing.assert_array_equal(a, b)
    everything = np.concatenate(split.client_indices)
    assert len(everything) == 1438
    np.testing.assert_array_equal(np.sort(everything), np.arange(1438))
    assert min(len(i) for i in split.client_indices) >= workload.MIN_CLIENT_EXAMPLES


def test_split_is_label_skewed(split: workload.Split) -> None:
    # With Dirichlet(0.5) most clients miss several of the 10 classes.
    classes_per_client = [len(np.unique(split.y_train[i])) for i in split.client_indices]
    assert np.median(classes_per_client) < 10


def test_client_batches_cycle_through_each_clients_data(split: workload.Split) -> None:
    data = workload.client_data(split)
    steps, batch = workload.LOCAL_STEPS, workload.BATCH
    assert data.x.shape == (100, steps, batch, 64) and data.x.dtype == np.float32
    assert data.y.shape == (100, steps, batch) and data.y.dtype == np.int32
    assert data.counts.sum() == 1438
    c = int(np.argmin(data.counts))
    idx = split.client_indices[c]
    stream = np.concatenate([idx] * (steps * batch // len(idx) + 1))[: steps * batch]
    np.testing.assert_array_equal(data.y[c].reshape(-1), split.y_train[stream])
    np.testing.assert_array_equal(data.x[c].reshape(-1, 64), split.x_train[stream])


def test_cohort_schedule() -> None:
    sched = workload.cohort_schedule(0, 20)
    assert sched.shape == (20, workload.COHORT)
    for r, row in enumerate(sched):
        assert len(set(row.tolist())) == workload.COHORT
        assert row.min() >= 0 and row.max() < workload.NUM_CLIENTS
        np.testing.assert_array_equal(row, np.random.default_rng(r).choice(100, 10, replace=False))
    np.testing.assert_array_equal(workload.cohort_schedule(0, 20), sched)
    assert not np.array_equal(workload.cohort_schedule(1, 20), sched)


def test_large_population_is_deterministic_and_samples_the_training_set(
        split: workload.Split) -> None:
    import large_workload

    pop = large_workload.Population(50, split=split)
    again = large_workload.Population(50, split=split)
    np.testing.assert_array_equal(pop.rows, again.rows)
    assert pop.rows.shape == (50, large_workload.EXAMPLES)
    assert pop.rows.min() >= 0 and pop.rows.max() < len(split.y_train)
    assert all(len(set(r.tolist())) == large_workload.EXAMPLES for r in pop.rows)
    x, y = pop.batches(np.asarray([3, 0]))
    assert x.shape == (2, workload.LOCAL_STEPS, workload.BATCH, workload.N_FEATURES)
    np.testing.assert_array_equal(x[1, 1], split.x_train[pop.rows[0, 16:32]])
    np.testing.assert_array_equal(y[0].ravel(), split.y_train[pop.rows[3]])
    clients = list(pop.clients())
    assert len(clients) == 50
    np.testing.assert_array_equal(clients[3]["xb"][0], x[0])
    assert clients[3]["counts"].tolist() == [large_workload.EXAMPLES]
    ids = large_workload.cohort(0, 2)
    assert len(set(ids.tolist())) == large_workload.COHORT
    assert ids.max() < large_workload.POPULATION
    np.testing.assert_array_equal(ids, large_workload.cohort(0, 2))


def test_committed_init_params_match_their_generator() -> None:
    stored = workload.load_init_params()
    fresh = workload.make_init_params()
    for k, shape in workload.PARAM_SHAPES.items():
        assert stored[k].shape == shape and stored[k].dtype == np.float32
        np.testing.assert_array_equal(stored[k], fresh[k])
    limit = np.sqrt(6.0 / (64 + 64))
    assert np.abs(stored["w1"]).max() <= limit and np.abs(stored["w1"]).max() > 0.9 * limit
    assert not stored["b1"].any() and not stored["b2"].any()


def test_numpy_reference_gradient_matches_finite_differences() -> None:
    params, x, y = workload.check_program_inputs()
    loss, grads = numpy_mlp.loss_and_grad(params, x[0], y[0])
    p64 = {k: v.astype(np.float64) for k, v in params.items()}

    def f(p: dict) -> float:
        return workload.softmax_xent(workload.forward(p, x[0].astype(np.float64)), y[0])

    assert abs(f(p64) - loss) < 1e-5
    rng = np.random.default_rng(1)
    for k in workload.PARAM_NAMES:
        for flat in rng.choice(p64[k].size, 3, replace=False):
            i = np.unravel_index(flat, p64[k].shape)
            up = {n: v.copy() for n, v in p64.items()}
            dn = {n: v.copy() for n, v in p64.items()}
            up[k][i] += 1e-5
            dn[k][i] -= 1e-5
            assert abs((f(up) - f(dn)) / 2e-5 - grads[k][i]) < 1e-4


def test_run_peer_reports_a_missing_venv(tmp_path) -> None:
    with pytest.raises(run_peer.PeerUnavailable, match="setup_venvs.sh fax"):
        run_peer.run_peer("fax", rounds=1, repo=str(tmp_path))


@pytest.fixture(scope="module")
def reference_round0() -> float:
    losses, _ = numpy_mlp.fedavg(1)
    return losses[0]


@pytest.mark.peers
@pytest.mark.parametrize("peer", run_peer.PEERS)
def test_peer_runs_one_round(peer: str, reference_round0: float, peer_venv) -> None:
    peer_venv(peer)
    result = run_peer.run_peer(peer, rounds=1, seed=0)
    assert result["peer"] == peer
    for key in ("setup_s", "round_s_median", "round_s_all", "peak_rss_mb",
                "final_test_accuracy", "loss_per_round", "bytes_moved"):
        assert key in result
    assert len(result["round_s_all"]) == 1 and len(result["loss_per_round"]) == 1
    assert result["setup_s"] > 0 and result["peak_rss_mb"] > 0
    # Same math in every peer: round 0's training loss agrees with the numpy reference.
    assert abs(result["loss_per_round"][0] - reference_round0) < 1e-4
    assert 0.0 <= result["final_test_accuracy"] <= 1.0


def test_run_flower_sizes_reports_a_missing_venv(tmp_path) -> None:
    with pytest.raises(run_peer.PeerUnavailable, match="setup_venvs.sh flower"):
        run_peer.run_flower_sizes(["10k"], rounds=2, repo=str(tmp_path))


@pytest.mark.peers
def test_flower_sizes_matches_the_numpy_reference(peer_venv) -> None:
    peer_venv("flower")
    import flower_sizes

    (result,) = run_peer.run_flower_sizes(["10k"], rounds=2, seed=0)
    assert result["peer"] == "flower-sizes" and result["params"] == 10_000
    assert len(result["round_s_all"]) == 2 and result["peak_rss_mb"] > 0
    assert result["bytes_moved_per_round"] >= result["payload_bytes_per_round"] == 800_000
    # Checked here too, in this venv's numpy: the same data, rounds and weights.
    ref = flower_sizes.reference(0, 100, 2)
    assert result["max_abs_diff_final"] < 1e-5 and result["max_abs_diff_round1"] < 1e-5
    assert abs(result["round1_sum"] - float(np.sum(ref[0], dtype=np.float64))) < 1e-3
    assert abs(result["final_sum"] - float(np.sum(ref[1], dtype=np.float64))) < 1e-3
    w0, x, y = flower_sizes.problem(0, 100)
    loss0 = np.mean([flower_sizes.sgd_step(w0, x[i], y[i])[1] for i in range(10)])
    assert abs(result["train_loss_per_round"][0] - loss0) < 1e-4
