"""The ServerApp's initial state (`bundle.read_state`): only a regular file, never a
link or a FIFO; each header checked before anything is allocated; each entry the dtype
and shape the round expects, never another dtype relabelled; and, where round.json
records it, the very file the app was written with."""

from __future__ import annotations

import io
import os
import threading
import zipfile

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fax_bridge.errors import ExportError
from fax_bridge.flower import bundle

STATE = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array(7, np.int32),
         np.array([1.5, -2.0], ml_dtypes.bfloat16)]


def _npz(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def test_the_state_written_reads_back_bit_for_bit_with_its_recorded_hash(tmp_path):
    path = bundle.write_state(STATE, str(tmp_path / "s.npz"))
    digest = bundle.state_sha256(path)
    got = bundle.read_state(path, STATE, digest)
    assert [(t.dtype, t.shape, t.tobytes()) for t in got] == \
        [(t.dtype, t.shape, t.tobytes()) for t in STATE]


def test_a_state_of_the_right_layout_but_not_the_one_recorded_is_refused(tmp_path):
    recorded = bundle.state_sha256(bundle.write_state(STATE, str(tmp_path / "a.npz")))
    other = [t + 1 for t in STATE]
    path = bundle.write_state(other, str(tmp_path / "b.npz"))
    bundle.read_state(path, STATE)  # the layout alone holds
    with pytest.raises(ExportError) as caught:
        bundle.read_state(path, STATE, recorded)
    assert f"initial-state {path}" in str(caught.value) and recorded in str(caught.value)
    assert "written for another round or changed since" in str(caught.value)


def test_a_fifo_a_link_or_a_folder_is_refused_without_waiting(tmp_path):
    fifo = tmp_path / "fifo.npz"
    os.mkfifo(fifo)
    done = []
    reader = threading.Thread(target=lambda: done.append(_refusal(str(fifo))), daemon=True)
    reader.start()
    reader.join(60)
    if reader.is_alive():  # release the reader before failing
        with open(fifo, "wb"):
            pass
        pytest.fail("reading a FIFO as the initial state waited for a writer")
    assert "is a FIFO" in done[0]
    real = bundle.write_state(STATE, str(tmp_path / "real.npz"))
    os.symlink(real, tmp_path / "link.npz")
    assert "is a symbolic link" in _refusal(str(tmp_path / "link.npz"))
    assert "is a folder" in _refusal(str(tmp_path))
    assert "no such file" in _refusal(str(tmp_path / "absent.npz"))


def _refusal(path: str) -> str:
    with pytest.raises(ExportError) as caught:
        bundle.read_state(path, STATE)
    assert path in str(caught.value) and "fax-bridge flower" in str(caught.value)
    return str(caught.value)


def _claiming(shape: tuple, dtype=np.float32, data: bytes = b"\0" * 16) -> bytes:
    """An npz whose member '0.npy' has a header claiming `shape` over `data`."""
    member = io.BytesIO()
    np.lib.format.write_array_header_1_0(member, {"descr": np.dtype(dtype).str,
                                                  "fortran_order": False, "shape": shape})
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("0.npy", member.getvalue() + data)
        archive.writestr("dtypes.npy", _npz_member(np.array(["float32"])))
    return buffer.getvalue()


def _npz_member(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array(out, array)
    return out.getvalue()


@settings(max_examples=30, deadline=None)
@given(shape=st.lists(st.integers(0, 2**20), min_size=1, max_size=4))
def test_a_header_claiming_more_than_the_file_holds_is_refused_before_allocating(
        tmp_path_factory, shape):
    like = [np.zeros(4, np.float32)]
    path = tmp_path_factory.mktemp("claim") / "s.npz"
    path.write_bytes(_claiming(tuple(shape)))
    try:
        got = bundle.read_state(str(path), like)
    except ExportError as e:
        assert f"initial-state {path}" in str(e)
        return
    assert int(np.prod(shape)) == 4 and got[0].shape == (4,)


def test_a_header_claiming_2_to_the_40_elements_is_a_named_refusal(tmp_path):
    path = tmp_path / "huge.npz"
    path.write_bytes(_claiming((2**40,)))
    with pytest.raises(ExportError, match=r"claim.*\[1099511627776\]"):
        bundle.read_state(str(path), [np.zeros(4, np.float32)])


DTYPES = [np.float32, np.int32, np.float64, np.int64, np.uint8, np.bool_,
          ml_dtypes.bfloat16, np.float16]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_entry_of_another_dtype_or_shape_is_refused_naming_it(tmp_path_factory, data):
    """Each entry is the dtype and shape the round expects, or its bytes where
    `write_state` keeps them so; an int32 entry labelled float32, or any other
    relabelling, reshaping or widening, is refused naming the entry, never
    reinterpreted."""
    like = [np.zeros(data.draw(st.lists(st.integers(1, 3), max_size=2)),
                     data.draw(st.sampled_from(DTYPES))) for _ in range(2)]
    which = data.draw(st.integers(0, 1))
    stored_dtype = data.draw(st.sampled_from(DTYPES))
    stored_shape = data.draw(st.sampled_from([like[which].shape, like[which].shape + (2,),
                                              (5,)]))
    label = data.draw(st.sampled_from(["expected", "stored"]))
    arrays = {str(i): np.asarray(t) for i, t in enumerate(like)}
    names = [np.dtype(t.dtype).name for t in like]
    value = np.zeros(stored_shape, stored_dtype)
    if value.dtype.name != np.dtype(value.dtype.str).name:
        value = value.reshape(value.shape + (1,)).view(np.uint8)  # as write_state would
    arrays[str(which)] = value
    if label == "stored":
        names[which] = np.dtype(stored_dtype).name
    for key, array in arrays.items():
        if array.dtype.name != np.dtype(array.dtype.str).name:
            arrays[key] = array.reshape(array.shape + (1,)).view(np.uint8)
    path = tmp_path_factory.mktemp("entries") / "s.npz"
    path.write_bytes(_npz(dtypes=np.array(names), **arrays))
    want = like[which]
    same = (np.dtype(stored_dtype) == want.dtype and stored_shape == want.shape) or (
        bundle._needs_bytes(want.dtype) and np.dtype(stored_dtype) == np.uint8  # its bytes,
        and stored_shape == want.shape + (want.dtype.itemsize,)  # labelled as write_state
        and label == "expected")  # labels them: with the round's dtype, not "uint8"
    try:
        got = bundle.read_state(str(path), like)
    except ExportError as e:
        assert not same
        assert f"entry '{which}'" in str(e) and "written for another round" in str(e)
        assert f"{np.dtype(like[which].dtype).name}{list(like[which].shape)}" in str(e)
        return
    assert same and [(t.dtype, t.shape) for t in got] == [(t.dtype, t.shape) for t in like]


def test_int32_data_labelled_float32_is_refused_not_reinterpreted(tmp_path):
    path = tmp_path / "s.npz"
    path.write_bytes(_npz(dtypes=np.array(["float32"]), **{"0": np.arange(4, dtype=np.int32)}))
    with pytest.raises(ExportError, match=r"entry '0' is 'float32' labelling int32\[4\], but "
                                          r"the round's state expects float32\[4\]"):
        bundle.read_state(str(path), [np.zeros(4, np.float32)])


# -------------------------------------------- rounds of several trips, client state

def _algorithm(name: str):
    """(program, args, placements) of one round of `name` on softmax regression, at 3
    clients (4 features, 3 classes, 2 batches of 4 per client)."""
    import jax
    import jax.numpy as jnp
    import optax

    from fax_bridge import algorithms as A

    def loss(params, batch):
        logp = jax.nn.log_softmax(batch["x"] @ params["w"] + params["b"])
        return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))

    rng = np.random.default_rng(1)
    data = {"x": rng.normal(size=(3, 2, 4, 4)).astype(np.float32),
            "y": rng.integers(0, 3, size=(3, 2, 4)).astype(np.int32)}
    mask = np.ones((3, 2, 4), bool)
    params = {"w": rng.normal(size=(4, 3)).astype(np.float32) * 0.1,
              "b": np.zeros(3, np.float32)}
    if name == "fed_sgd":
        alg = A.fed_sgd(loss, clients=3)
        return alg.next, (alg.init(params), data, mask), alg.placements
    if name == "streaming_diloco":
        alg = A.streaming_diloco(loss, params, clients=3, sync_every=4, num_fragments=2,
                                 overlap=1, quantize=True)
        return alg.rounds[0], (alg.init(params), data, mask), alg.placements
    alg = getattr(A, name)(loss, optax.sgd(0.1), clients=3)
    return alg.next, (alg.init(params), data, mask, data, mask), alg.placements


# name -> (trips, [(trip, the earlier trip whose client values it reads)], client state)
PHASED = {"fed_sgd": (2, [(2, 1)], None),
          "learned_server_lr": (3, [(3, 2)], None),
          "learned_client_weights": (4, [(3, 2), (4, 1)], "arg0.logits"),
          "streaming_diloco": (2, [(2, 1)], "arg0.worker_params['b']")}


@pytest.mark.parametrize("name", sorted(PHASED))
def test_a_round_of_several_trips_or_client_state_is_refused_naming_why_and_where(name):
    fn, args, placements = _algorithm(name)
    with pytest.raises(ExportError) as caught:
        bundle.build_round(fn, *args, placements=placements)
    text = str(caught.value)
    trips, kept, state = PHASED[name]
    assert text.startswith(f"the round {name}.") and \
        f"cannot run on Flower: its round asks the clients {trips} times " \
        "(federated_broadcast at " in text
    for trip, earlier in kept:
        assert f"trip {trip}'s client computation (" in text
        assert f"reads what each client computed in trip {earlier}" in text
    assert "one `train` message to each SuperNode" in text
    if state is None:
        assert "state at the clients" not in text and "fed_sgd_one_trip" in text
    else:
        assert f"its round keeps state at the clients from round to round ({state}" in text
        assert "would leave the SuperNode unaggregated" in text
    assert 'LocalFleet(devices=N, client_runtime="xla" or "litert")' in text
    assert "fax-bridge parity TARGET --devices N [--litert]" in text


def test_a_parity_check_on_flower_names_the_trips_before_the_argument_count():
    """`check_parity(..., flower=True)` of fed_sgd (state, data, mask) says why no
    wrapping into (state, client_data) would let it run, before the argument count;
    a round of one trip with three arguments gets the argument count alone."""
    import fax_bridge as fb
    from fax_bridge.errors import ArgumentError

    fn, args, placements = _algorithm("fed_sgd")
    with pytest.raises(ExportError, match=r"the round fed_sgd\.next_fn cannot run on "
                       "Flower: its round asks the clients 2 times"):
        fb.check_parity(fn, *args, placements=placements, flower=True)

    @fb.program(clients=3)
    def one_trip(w, x, m):
        return w, fb.federated_mean(fb.federated_map_clients(
            lambda a, b, c: a * b * c, (fb.federated_broadcast(w), x, m)))

    w, x = np.float32(1.0), np.ones((3, 2), np.float32)
    with pytest.raises(ArgumentError, match=r"takes \(state, client_data\), here 3"):
        fb.check_parity(one_trip, w, x, x, placements=("server", "clients", "clients"),
                        flower=True)


def test_the_one_trip_variant_the_refusal_names_builds_written_as_state_and_client_data():
    import jax
    import jax.numpy as jnp

    from fax_bridge import algorithms as A

    def loss(params, batch):
        logp = jax.nn.log_softmax(batch["x"] @ params["w"] + params["b"])
        return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))

    _, (_, data, mask), _ = _algorithm("fed_sgd")
    alg = A.fed_sgd_one_trip(loss, clients=3)
    state = alg.init({"w": np.zeros((4, 3), np.float32), "b": np.zeros(3, np.float32)})

    def one_trip_round(state, client_data):
        return alg.next(state, client_data["data"], client_data["mask"])

    made = bundle.build_round(one_trip_round, state, {"data": data, "mask": mask},
                              placements=("server", "clients"))
    assert made.argument_names == ["state", "client_data"] and len(made.aggregands) >= 1


THREE_ARGUMENTS = '''
import jax.numpy as jnp
import numpy as np
import fax_bridge as fb


def masked_mean(state, batches, mask):
    total = fb.federated_map_clients(lambda b, m: jnp.sum(b * m), (batches, mask))
    return state, fb.federated_mean(total)


def flower_round(state, client_data):  # the wrapper the refusal shows
    batches = client_data['batches']
    mask = client_data['mask']
    return masked_mean(state, batches, mask)


def masked_mean_example_args(clients):
    data = np.ones((clients, 4), np.float32)
    return (np.float32(0), data, data > 0), ("server", "clients", "clients")


def flower_round_example_args(clients):
    (state, data, mask), _ = masked_mean_example_args(clients)
    return (state, {'batches': data, 'mask': mask}), ("server", "clients")
'''


def test_a_round_of_three_arguments_is_refused_naming_them_and_the_wrapper(
        tmp_path, capsys, monkeypatch):
    from fax_bridge import cli
    from fax_bridge.tff import forms

    path = tmp_path / "three.py"
    path.write_text(THREE_ARGUMENTS)

    def never(*args, **kwargs):
        raise AssertionError("the round was exported before its arguments were checked")

    with monkeypatch.context() as m:
        m.setattr(forms, "round_proto", never)
        rc = cli.main(["flower", f"{path}:masked_mean", "--clients", "3", "-o",
                       str(tmp_path / "app")])
    err = capsys.readouterr().err
    assert rc == 2 and "takes 2 arguments" not in err, err
    assert "rounds (state, client_data)" in err and "masked_mean takes 3 (state@SERVER, " \
        "batches@CLIENTS, mask@CLIENTS)" in err, err
    assert "def flower_round(state, client_data):\n        batches = client_data['batches']\n" \
        "        mask = client_data['mask']\n" \
        "        return program(state, batches, mask)" in err, err
    assert "(state, {'batches': batches, 'mask': mask})" in err, err
    assert "a tuple" not in err and not (tmp_path / "app").exists(), err
    # the wrapper it shows is a round an app is written for, populations and all
    assert cli.main(["flower", f"{path}:flower_round", "--clients", "3", "-o",
                     str(tmp_path / "app"), "--write-population",
                     str(tmp_path / "pops")]) == 0, capsys.readouterr().err


def test_a_round_of_one_argument_is_refused_asking_for_the_clients_data():
    def alone(state):
        return state, state

    with pytest.raises(ExportError, match=r"alone takes 1 \(state@SERVER\); give it the "
                                          "clients' data as its second argument"):
        bundle.build_round(alone, np.float32(0), placements=("server",))


@pytest.mark.parametrize("count", [0, 1, 3, 4])
def test_arguments_a_round_does_not_take_are_left_to_the_arity_refusal(count):
    """refuse_phased traces nothing for arguments the program cannot take (no raw
    TypeError from the user's function); `refuse_arity` then names what to give."""
    def traced(*a, **k):
        raise AssertionError("traced a call the program cannot take")

    def step(state, client_data):
        return traced()

    bundle.refuse_phased(step, tuple(range(count)))  # returns
    with pytest.raises(ExportError, match=f"step takes {count}"):
        bundle.refuse_arity(step, tuple(range(count)))


def test_the_wrapper_the_refusal_shows_folds_server_arguments_into_the_state():
    """A program with SERVER arguments beside its state: the refusal shows a round of
    two arguments that folds them into the state and carries them to the next round;
    that wrapper, run as shown, builds a Flower round whose rounds are the program's."""
    import textwrap

    import jax.numpy as jnp

    import fax_bridge as fb
    from fax_bridge.in_process import run_computation

    @fb.program(clients=3)
    def scaled_mean(state, batches, lr, mask):
        step = fb.federated_broadcast(state * lr)
        total = fb.federated_map_clients(lambda s, b, m: jnp.sum(b * m) * s,
                                         (step, batches, mask))
        return state - fb.federated_mean(total), fb.federated_sum(total)

    batches = np.arange(12, dtype=np.float32).reshape(3, 4)
    args = (np.float32(1.0), batches, np.float32(0.5), batches > 2)
    with pytest.raises(ExportError) as refused:
        bundle.build_round(scaled_mean, *args, clients=3,
                           placements=("server", "clients", "server", "clients"))
    text = str(refused.value)
    assert "whose state holds its SERVER arguments (state, lr)" in text, text
    assert "example arguments ((state, lr), {'batches': batches, 'mask': mask})" in text, text
    shown = text.split("e.g.\n", 1)[1].split("\nwith program = ", 1)[0]
    assert shown == ("    def flower_round(server_state, client_data):\n"
                     "        state, lr = server_state\n"
                     "        batches = client_data['batches']\n"
                     "        mask = client_data['mask']\n"
                     "        new_state, output = program(state, batches, lr, mask)\n"
                     "        return (new_state, lr), output"), shown
    scope = {"program": scaled_mean}
    exec(textwrap.dedent(shown), scope)  # the wrapper exactly as the refusal shows it
    state, _, lr, mask = args
    made = bundle.build_round(scope["flower_round"], (state, lr),
                              {"batches": batches, "mask": mask},
                              placements=("server", "clients"), clients=3)
    assert made.split is not None
    carried = (state, lr)
    for _ in range(2):  # the state carries lr to the next round unchanged
        carried, output = run_computation(made.proto, carried,
                                          {"batches": batches, "mask": mask})
        totals = (batches * mask).sum(axis=1) * state * lr
        state = np.float32(state - totals.mean())
        assert float(carried[1]) == float(lr) and np.isclose(float(carried[0]), state)
        assert np.isclose(float(output), totals.sum())


def test_the_wrapper_for_an_algorithm_round_holds_a_dict_arguments_entries_flat():
    """An algorithm's `next(state, batches, mask)` with batches a dict of arrays: the
    wrapper the refusal shows takes one flat dict of arrays (what a SuperNode's
    population stores), the round's real name leading it; run as shown, it builds."""
    import textwrap

    import jax.numpy as jnp
    import optax

    from fax_bridge import algorithms as A

    def loss(params, batch):
        return jnp.mean((batch["x"] @ params - batch["y"]) ** 2)

    alg = A.fed_adam(loss, optax.sgd(0.1), clients=3)
    batches = {"x": np.ones((3, 2, 4, 5), np.float32), "y": np.ones((3, 2, 4), np.float32)}
    mask = np.ones((3, 2, 4), bool)
    state = alg.init(np.zeros(5, np.float32))
    with pytest.raises(ExportError) as refused:
        bundle.build_round(alg.next, state, batches, mask, placements=alg.placements)
    text = str(refused.value)
    assert "fed_adam.next_fn takes 3" in text and "a tuple" not in text, text
    shown = text.split("e.g.\n", 1)[1].split("\nwith program = ", 1)[0]
    assert shown == ("    def flower_round(state, client_data):\n"
                     "        batches = {'x': client_data['x'], 'y': client_data['y']}\n"
                     "        mask = client_data['mask']\n"
                     "        return program(state, batches, mask)"), shown
    assert "example arguments (state, {'x': batches['x'], 'y': batches['y'], " \
        "'mask': mask})" in text, text
    scope = {"program": alg.next}
    exec(textwrap.dedent(shown), scope)
    made = bundle.build_round(scope["flower_round"], state,
                              {"x": batches["x"], "y": batches["y"], "mask": mask},
                              placements=("server", "clients"))
    assert made.argument_names == ["state", "client_data"]
