"""Client datasets for federated programs: partitioning, padding, streaming, sampling.

A client dataset is a dict of numpy arrays that share a leading example axis. A
population is a list of them (or a directory on disk, see `stream`). Before a round,
a cohort of clients is padded to a common size (`padding`) so the per-client
computation stays one vectorized map over a leading clients axis.
"""

from fax_bridge.data.partition import (
    dirichlet_label_skew, partition_by_key, partition_dirichlet, split_clients)
from fax_bridge.data.padding import PaddedClients, pad_clients, to_batches
from fax_bridge.data.sampling import CohortSampler, PoissonSampler, sample_cohort
from fax_bridge.data.stream import ClientStore, write_population
from fax_bridge.data.digits import FederatedDigits, load_federated_digits

__all__ = [
    "ClientStore", "CohortSampler", "FederatedDigits", "PaddedClients", "PoissonSampler",
    "dirichlet_label_skew", "load_federated_digits", "pad_clients", "partition_by_key",
    "partition_dirichlet", "sample_cohort", "split_clients", "to_batches",
    "write_population",
]
