"""Privacy accounting through Google's `dp-accounting`: (epsilon, delta) of DP rounds.

A round of a DP aggregator is one Gaussian mechanism of noise multiplier z (for adaptive
clipping, z is the total one: values and clipped count together) applied to a sampled
cohort. How the cohort is drawn decides the event:

- `"poisson"`: every client of the population joins independently with probability q
  (`PoissonSampledDpEvent`); accounted under add-or-remove-one, by RDP or PLD.
- `"fixed"`: exactly `cohort` clients drawn uniformly without replacement from
  `population` (`SampledWithoutReplacementDpEvent`); `dp-accounting` accounts this only
  with RDP under replace-one adjacency.

`T` rounds are the event self-composed `T` times.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Optional

import dp_accounting

from fax_bridge.errors import PrivacyError

# RDP orders: fractional ones near 1 matter for small epsilon, large ones for small delta.
RDP_ORDERS = tuple([1.25 + 0.25 * i for i in range(36)] + list(range(11, 65))
                   + [80, 96, 128, 256, 512, 1024])
METHODS = ("rdp", "pld")
SAMPLING = ("poisson", "fixed")



@contextlib.contextmanager
def _quiet_rdp_orders():
    """dp-accounting logs a warning for each fractional RDP order whose series converges
    slowly (that order is then left out); it is about its numerics, not the settings."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        log.setLevel(level)


def _check(name: str, value, low: float, high: float = math.inf, low_open: bool = False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value) or value < low or (low_open and value == low) or value > high:
        bound = f"{'>' if low_open else '>='} {low:g}" + (
            f" and <= {high:g}" if math.isfinite(high) else "")
        raise PrivacyError(f"{name} must be a finite number {bound}, got {value!r}.")
    return value


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each round's cohort is drawn: Poisson with `rate`, or `cohort` of `population`."""

    kind: str
    rate: float
    population: Optional[int] = None
    cohort: Optional[int] = None

    @staticmethod
    def poisson(rate: float) -> "Sampling":
        return Sampling("poisson", float(_check("sampling rate", rate, 0.0, 1.0, low_open=True)))

    @staticmethod
    def fixed(cohort: int, population: int) -> "Sampling":
        if isinstance(cohort, bool) or not isinstance(cohort, int) or isinstance(
                population, bool) or not isinstance(population, int) or not (
                1 <= cohort <= population):
            raise PrivacyError(
                f"fixed-size sampling needs integers 1 <= cohort <= population, got cohort="
                f"{cohort!r}, population={population!r}.")
        return Sampling("fixed", cohort / population, population, cohort)


def round_event(noise_multiplier: float, sampling: Sampling) -> dp_accounting.DpEvent:
    """The DpEvent of one round: the sampled Gaussian mechanism."""
    z = _check("noise_multiplier", noise_multiplier, 0.0)
    gaussian = dp_accounting.GaussianDpEvent(z)
    if sampling.kind == "poisson":
        return dp_accounting.PoissonSampledDpEvent(sampling.rate, gaussian)
    return dp_accounting.SampledWithoutReplacementDpEvent(
        sampling.population, sampling.cohort, gaussian)


def _accountant(method: str, sampling: Sampling, pld_interval: float = 1e-4):
    if method not in METHODS:
        raise PrivacyError(f"method must be one of {METHODS}, got {method!r}.")
    if sampling.kind == "fixed":
        if method != "rdp":
            raise PrivacyError(
                "dp-accounting's PLD accountant has no fixed-size (without replacement) "
                "sampling; use method='rdp' or Poisson sampling.")
        return dp_accounting.rdp.RdpAccountant(
            RDP_ORDERS, dp_accounting.NeighboringRelation.REPLACE_ONE)
    if method == "rdp":
        return dp_accounting.rdp.RdpAccountant(RDP_ORDERS)
    return dp_accounting.pld.PLDAccountant(value_discretization_interval=pld_interval)


def epsilon(noise_multiplier: float, sampling: Sampling, rounds: int, delta: float,
            method: str = "rdp") -> float:
    """The epsilon of `rounds` rounds at `delta` (inf without noise)."""
    _check("delta", delta, 0.0, 1.0, low_open=True)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise PrivacyError(f"rounds must be an int >= 0, got {rounds!r}.")
    if rounds == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    acc = _accountant(method, sampling)
    with _quiet_rdp_orders():
        acc.compose(round_event(noise_multiplier, sampling), rounds)
        return float(acc.get_epsilon(delta))


def calibrate_noise_multiplier(target_epsilon: float, delta: float, sampling: Sampling,
                               rounds: int, method: str = "rdp") -> float:
    """The smallest noise multiplier whose `rounds` rounds stay within (target_epsilon, delta)."""
    _check("target_epsilon", target_epsilon, 0.0, low_open=True)
    _check("delta", delta, 0.0, 1.0, low_open=True)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise PrivacyError(f"rounds must be an int >= 1, got {rounds!r}.")
    _accountant(method, sampling)  # validates the combination before the search
    if method == "pld":
        # PLD is costly (and huge) at tiny multipliers: search below RDP's answer, which
        # is an upper bound, down to half of it (wider only if that is not low enough),
        # on a 10x coarser grid of privacy-loss values, which can only overstate epsilon.
        high = calibrate_noise_multiplier(target_epsilon, delta, sampling, rounds, "rdp")
        low = high / 2
        while epsilon(low, sampling, rounds, delta, "pld") <= target_epsilon:
            high, low = low, low / 2
        bracket = dp_accounting.ExplicitBracketInterval(low, high)
    else:
        bracket = dp_accounting.LowerEndpointAndGuess(1e-3, 1.0)
    try:
        with _quiet_rdp_orders():
            return float(dp_accounting.calibrate_dp_mechanism(
                lambda: _accountant(method, sampling, pld_interval=1e-3),
                lambda z: dp_accounting.SelfComposedDpEvent(round_event(z, sampling), rounds),
                target_epsilon, delta, bracket, tol=1e-3 if method == "pld" else 1e-4))
    except (ValueError, RuntimeError) as e:
        raise PrivacyError(
            f"no noise multiplier reaches epsilon={target_epsilon:g} at delta={delta:g} over "
            f"{rounds} rounds with {sampling}: {e}") from e


@dataclasses.dataclass(frozen=True)
class PrivacyReport:
    """The guarantee after `rounds` rounds: epsilon by RDP and (Poisson sampling) by PLD."""

    rounds: int
    noise_multiplier: float
    sampling_rate: float
    delta: float
    epsilon_rdp: float
    epsilon_pld: Optional[float]

    def summary(self) -> str:
        pld = "" if self.epsilon_pld is None else f", PLD eps={self.epsilon_pld:.3f}"
        return (f"after {self.rounds} rounds (z={self.noise_multiplier:.3f}, q="
                f"{self.sampling_rate:.3g}): RDP eps={self.epsilon_rdp:.3f}{pld} at "
                f"delta={self.delta:g}")


class PrivacyLedger:
    """Counts DP rounds and reports the guarantee so far; one per training run."""

    def __init__(self, noise_multiplier: float, sampling: Sampling, delta: float):
        _check("noise_multiplier", noise_multiplier, 0.0)
        _check("delta", delta, 0.0, 1.0, low_open=True)
        self.noise_multiplier = float(noise_multiplier)
        self.sampling = sampling
        self.delta = float(delta)
        self.rounds = 0

    def step(self, rounds: int = 1) -> PrivacyReport:
        """Records `rounds` more rounds; returns the report after them."""
        self.rounds += rounds
        return self.report()

    def report(self, pld: bool = True) -> PrivacyReport:
        """epsilon so far by RDP, and by PLD when `pld` and the sampling is Poisson."""
        rdp = epsilon(self.noise_multiplier, self.sampling, self.rounds, self.delta, "rdp")
        use_pld = pld and self.sampling.kind == "poisson"
        return PrivacyReport(
            self.rounds, self.noise_multiplier, self.sampling.rate, self.delta, rdp,
            epsilon(self.noise_multiplier, self.sampling, self.rounds, self.delta, "pld")
            if use_pld else None)
