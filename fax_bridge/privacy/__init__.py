"""Differential privacy for federated programs: DP aggregation and accounting.

`gaussian_fixed` / `gaussian_adaptive` build DP means written with the federated
primitives (clip at clients, noise at the server from a server-placed key), with the
conventions of TFF's `DifferentiallyPrivateFactory`; `epsilon`,
`calibrate_noise_multiplier` and `PrivacyLedger` account for them with `dp-accounting`.
"""

from fax_bridge.privacy.accounting import (
    PrivacyLedger, PrivacyReport, Sampling, calibrate_noise_multiplier, epsilon, round_event)
from fax_bridge.privacy.aggregator import (
    DPAggregator, DPState, adaptive_clip_noise_params, gaussian_adaptive, gaussian_fixed)
from fax_bridge.privacy.clipping import clip_by_global_norm, global_l2_norm

__all__ = [
    "DPAggregator", "DPState", "PrivacyLedger", "PrivacyReport", "Sampling",
    "adaptive_clip_noise_params", "calibrate_noise_multiplier", "clip_by_global_norm",
    "epsilon", "gaussian_adaptive", "gaussian_fixed", "global_l2_norm", "round_event",
]
