"""Accounting with dp-accounting: known values, monotonicity, calibration, errors."""

from __future__ import annotations

import math

import dp_accounting
import pytest

from fax_bridge import privacy
from fax_bridge.errors import PrivacyError

DELTA = 1e-5


def test_unsampled_rounds_compose_to_one_gaussian():
    # T rounds of a Gaussian of multiplier z (everyone every round) are one Gaussian of
    # multiplier z / sqrt(T); PLD is tight for it.
    z, rounds = 4.0, 16
    exact = dp_accounting.get_epsilon_gaussian(z / math.sqrt(rounds), DELTA)
    pld = privacy.epsilon(z, privacy.Sampling.poisson(1.0), rounds, DELTA, "pld")
    rdp = privacy.epsilon(z, privacy.Sampling.poisson(1.0), rounds, DELTA, "rdp")
    assert pld == pytest.approx(exact, rel=0.02)
    assert rdp >= exact * 0.999                     # RDP is an upper bound


def test_epsilon_moves_the_right_way():
    s = privacy.Sampling.poisson(0.05)
    base = privacy.epsilon(1.0, s, 100, DELTA)
    assert privacy.epsilon(2.0, s, 100, DELTA) < base            # more noise
    assert privacy.epsilon(1.0, s, 400, DELTA) > base            # more rounds
    assert privacy.epsilon(1.0, privacy.Sampling.poisson(0.2), 100, DELTA) > base
    assert privacy.epsilon(1.0, s, 100, DELTA, "pld") <= base    # PLD is tighter
    assert privacy.epsilon(0.0, s, 1, DELTA) == math.inf
    assert privacy.epsilon(1.0, s, 0, DELTA) == 0.0
    fixed = privacy.epsilon(1.0, privacy.Sampling.fixed(5, 100), 100, DELTA)
    assert math.isfinite(fixed) and fixed > 0


def test_calibrated_noise_meets_the_target():
    s = privacy.Sampling.poisson(0.1)
    for method, rounds in (("rdp", 50), ("pld", 10)):
        z = privacy.calibrate_noise_multiplier(3.0, DELTA, s, rounds, method)
        eps = privacy.epsilon(z, s, rounds, DELTA, method)
        assert eps <= 3.0 * 1.001 and eps > 3.0 * 0.97, (method, z, eps)


def test_ledger_reports_each_round():
    ledger = privacy.PrivacyLedger(1.0, privacy.Sampling.poisson(0.1), DELTA)
    first = ledger.step()
    later = ledger.step(9)
    assert (first.rounds, later.rounds) == (1, 10)
    assert later.epsilon_rdp > first.epsilon_rdp and later.epsilon_pld is not None
    assert "RDP eps=" in later.summary() and "PLD eps=" in later.summary()


def test_bad_requests_are_privacy_errors():
    with pytest.raises(PrivacyError, match="PLD"):
        privacy.epsilon(1.0, privacy.Sampling.fixed(5, 100), 10, DELTA, "pld")
    with pytest.raises(PrivacyError, match="sampling rate"):
        privacy.Sampling.poisson(0.0)
    with pytest.raises(PrivacyError, match="cohort"):
        privacy.Sampling.fixed(200, 100)
    with pytest.raises(PrivacyError, match="delta"):
        privacy.epsilon(1.0, privacy.Sampling.poisson(0.1), 10, 0.0)
    with pytest.raises(PrivacyError, match="method"):
        privacy.epsilon(1.0, privacy.Sampling.poisson(0.1), 10, DELTA, "moments")
