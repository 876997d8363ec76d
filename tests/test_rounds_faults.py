"""A planted fault (`rounds.faults.Fault`): a fleet's device started with it makes
`check_parity` fail on exactly the output its leaf feeds, and pass with rel=0; its
`--fault` flag reads back what `device_args` writes and refuses anything else by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from perturbed_runtime import InProcessFleet

import fax_bridge as fb
from fax_bridge.errors import ArgumentError
from fax_bridge.fleet import device_cli
from fax_bridge.rounds import faults
from fax_bridge.rounds.faults import Fault

N = 3
PLACE = ("server", "clients")


@fb.program(clients=N)
def _round(params, data):
    """Each client's model change (one gradient step) and loss, averaged: the mean's
    value per client is (update of w, loss), leaves "0" and "1"."""
    def local(p, d):
        loss, g = jax.value_and_grad(lambda q: jnp.mean((d @ q["w"]) ** 2))(p)
        return jax.tree.map(lambda a: -0.1 * a, g), loss

    delta, loss = fb.federated_map_clients(local, (fb.federated_broadcast(params), data))
    return {"delta": fb.federated_mean(delta), "loss": fb.federated_mean(loss)}


def _args():
    rng = np.random.default_rng(1)
    return ({"w": rng.normal(size=(3, 2)).astype(np.float32)},
            rng.normal(size=(N, 4, 3)).astype(np.float32))


def _parity(fault):
    with fb.LocalFleet(devices=1, client_runtime=fault) as fleet:
        return fb.check_parity(_round, *_args(), placements=PLACE, fleet=fleet,
                               client_runtime=fault)


def test_a_fleet_device_with_a_fault_fails_parity_on_the_leaf_it_feeds():
    """The update of one client 1e-3 off in its first element: the model change fails,
    the loss (larger, and what the largest-element default would pick) passes."""
    report = _parity(Fault("xla", aggregation="mean", leaf="0", element=0, rel=1e-3,
                           client=1))
    assert not report.ok
    assert [leaf.path for leaf in report.leaves if not leaf.ok] == \
        ["result['delta']['w']"], report.table()
    assert "PARITY MISMATCH" in report.table()


def test_a_fault_of_rel_zero_passes():
    report = _parity(Fault("xla", aggregation="mean", leaf="0", rel=0.0, client=1))
    assert report.ok, report.table()


def test_a_leaf_the_value_lacks_is_refused_listing_its_leaves():
    fault = Fault("xla", aggregation="mean", leaf="params/d1")
    with pytest.raises(ArgumentError, match=r"no such leaf; its leaves: '0' float32\[3, 2\], "
                                            r"'1' float32\[\]"):
        fb.check_parity(_round, *_args(), placements=PLACE, fleet=InProcessFleet(fault),
                        client_runtime=fault)


def test_an_element_past_the_leaf_is_refused():
    fault = Fault("xla", aggregation="mean", leaf="1", element=1)
    with pytest.raises(ArgumentError, match="element=1: leaf '1' of aggregation 0 has 1 "):
        fb.check_parity(_round, *_args(), placements=PLACE, fleet=InProcessFleet(fault),
                        client_runtime=fault)


FAULTS = st.builds(
    Fault, base=st.sampled_from(faults.BASES), how=st.sampled_from(faults.HOWS),
    rel=st.floats(-1e6, 1e6), client=st.integers(0, 10 ** 6),
    aggregation=st.none() | st.integers(0, 99) | st.sampled_from(["mean", "sum", "max"]),
    leaf=st.none() | st.from_regex(r"[a-z0-9_]{1,6}(/[a-z0-9_]{1,6}){0,2}", fullmatch=True),
    element=st.none() | st.integers(0, 10 ** 6))


@settings(max_examples=60, deadline=None)
@given(FAULTS)
def test_device_args_read_back_as_the_same_fault(fault):
    args = fault.device_args()
    assert args[-2] == "--fault"
    assert faults.parse(args[-1], base=fault.base) == fault
    device_cli._fault(args[-1])  # the device takes it


BAD = [
    ("nope=1", "unknown key 'nope'"), ("client", "'client' is not key=value"),
    ("client=", "'client=' is not key=value"), ("", "empty"),
    ("client=-1", "client='-1': expected an integer >= 0"),
    ("client=1.5", "client='1.5': expected an integer >= 0"),
    ("element=x", "element='x'"), ("client=1,client=2", "client given twice"),
    ("rel=abc", "rel='abc': expected a number"), ("rel=nan", "rel=nan: expected a finite"),
    ("rel=inf", "rel=inf"), ("rel=1e9", "rel=1000000000.0"),
    ("how=double", "how='double'"), ("aggregation=median", "aggregation='median'"),
    ("leaf=a b", "leaf='a b'"), ("leaf=$(rm)", "leaf='$(rm)'"),
]


@pytest.mark.parametrize("text, why", BAD)
def test_the_device_refuses_a_bad_fault_naming_it(text, why, capsys):
    with pytest.raises(SystemExit) as e:
        device_cli.main(["--fault", text])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--fault" in err and why in err, err


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=8).filter(
    lambda k: k.strip() not in faults.KEYS and "," not in k and "=" not in k),
    st.text(max_size=8).filter(lambda v: "," not in v), min_size=1, max_size=3),
    st.sampled_from(faults.KEYS), st.text(max_size=12).filter(lambda v: "," not in v))
def test_any_other_key_or_value_is_refused_by_name(extra, key, value):
    """A key not among KEYS is refused naming it; any value either parses into a
    valid Fault or is refused naming its key."""
    text = ",".join(f"{k}={v}" for k, v in extra.items())
    with pytest.raises(ArgumentError, match="--fault: "):
        faults.parse(text)
    try:
        fault = faults.parse(f"{key}={value}")
    except ArgumentError as e:
        assert key in str(e) or "not key=value" in str(e), str(e)
    else:
        assert faults.parse(fault.flag()) == fault
