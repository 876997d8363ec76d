"""Exceptions raised by fax_bridge; each message names what was wrong and how to fix it."""

from __future__ import annotations


class FaxBridgeError(Exception):
    """Base class of every error fax_bridge raises on purpose."""


class PlacementError(FaxBridgeError, TypeError):
    """A value is used at a placement it does not have (e.g. CLIENTS where SERVER is needed)."""


class ExportError(FaxBridgeError):
    """A program cannot be expressed as a TFF building-block computation."""


class ComputationError(FaxBridgeError):
    """A TFF computation proto is malformed, ill-typed or uses something unsupported."""


class DeclaredTypeError(ComputationError):
    """A computation proto declares a type its body does not have (e.g. f32@SERVER for a
    body that computes an unplaced f32)."""


class ClientCountError(ComputationError):
    """A computation places values at CLIENTS but nothing tells how many clients there are."""


class AggregationError(ComputationError):
    """An aggregation over clients cannot be computed (unknown kind, values of the wrong
    dtype or range, mismatched weights or structures, no clients)."""


class WeightError(AggregationError, ValueError):
    """The weights of a weighted mean are invalid: a client's weight is negative, or the
    clients' weights sum to zero (the mean would be 0/0)."""


class FleetError(FaxBridgeError):
    """A simulated device fleet could not complete a request (too few clients, dead devices...)."""


class TransferError(FleetError):
    """A value arrived other than its sender sent it: its sha256 on arrival is not the
    one the sender computed (a codec, a relay or a transport altered it), so a round
    fails rather than run on it."""


class AddressError(FleetError, ValueError):
    """A HOST:PORT address is malformed (no port, a port out of range, IPv6 without brackets)."""


class OutputError(FaxBridgeError):
    """A command's output folder cannot be written: the path is a file, too long or not
    writable, or writing would replace a file fax_bridge did not write there."""


class ArgumentError(FaxBridgeError, TypeError):
    """A function got an argument it does not take, or a combination it cannot use."""


class CheckpointError(FleetError):
    """A checkpoint is truncated or corrupt, or was made by another program."""


class CohortError(FleetError):
    """A round's cohort size and its population disagree (`rounds.cohort`: the policy's
    cohort size over the population, or `num_clients=` beside CLIENTS arguments that
    hold another number of clients)."""


class PrivacyError(FaxBridgeError, ValueError):
    """A differential-privacy setting is invalid or cannot give the requested guarantee."""


class HyperparameterError(FaxBridgeError, ValueError):
    """An algorithm's setting is out of its range or does not fit the model (a rate, a
    count, a fragment layout)."""


class DataError(FaxBridgeError, ValueError):
    """Client data cannot be partitioned, padded, sampled or stored as asked."""


class MeshError(FaxBridgeError, ValueError):
    """A device mesh or a multi-process layout does not fit the clients."""


class ProgramError(FaxBridgeError, ValueError):
    """A program is declared wrongly: its placement name, its cardinality, or the
    placements given for its arguments."""


class SecureAggregationError(FaxBridgeError, ValueError):
    """A client value lies outside the range a secure aggregation was declared with."""


class HloModuleError(ComputationError):
    """An Xla computation's HloModuleProto is malformed: refused by the checks run before
    XLA reads it, or XLA died reading it (in a separate process, so the caller lives)."""


class UnbatchedWarning(RuntimeWarning):
    """Clients run one call each where fax_bridge would run them as one batched call (the
    message says which computation and why): the same results, at a loss of speed."""
