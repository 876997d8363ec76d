"""Exceptions raised by fax_bridge; each message names what was wrong and how to fix it.

A `PlacementError` or `ProgramError` also names the line of the program's own code that
placed or called what it refuses (`user_location`: the innermost frame outside jax and
fax_bridge's machinery, `fax_bridge.algorithms` counting as a program), unless its
message names a line already (an equation's, found after tracing).
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from typing import Any, Optional

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))  # fax_bridge/
_ALGORITHMS_DIR = os.path.join(_PACKAGE_DIR, "algorithms")
_A_LINE = re.compile(r"\.py:\d+")
UNKNOWN_LOCATION = "<unknown location>"


def is_machinery(path: str) -> bool:
    """Whether a source file is fax_bridge's own machinery, which error locations skip.
    `fax_bridge.algorithms` is not: its rounds are programs like a user's, so an error in
    one points at its line."""
    path = os.path.abspath(path)
    return path.startswith(_PACKAGE_DIR + os.sep) and \
        not path.startswith(_ALGORITHMS_DIR + os.sep)


def user_location() -> str:
    """`file:line (function)` of the innermost stack frame of the program's own code:
    outside jax and fax_bridge's machinery (`is_machinery`)."""
    for frame, line in traceback.walk_stack(sys._getframe()):  # innermost first, unread
        name = frame.f_code.co_filename
        path = os.path.abspath(name)
        if is_machinery(path) or f"{os.sep}jax{os.sep}" in path \
                or f"{os.sep}jax_" in path or "contextlib" in path:
            continue
        return f"{name}:{line} ({frame.f_code.co_name})"
    return UNKNOWN_LOCATION


class _Located:
    """An error whose message ends with the user's line (`location`) unless it names a
    line already; `location=` gives it where the caller knows better."""

    def __init__(self, message: Any = "", *args: Any, location: Optional[str] = None):
        self.location = location or user_location()
        if isinstance(message, str) and message and not _A_LINE.search(message) \
                and self.location != UNKNOWN_LOCATION:
            message = f"{message} (at {self.location})"
        super().__init__(message, *args)


class FaxBridgeError(Exception):
    """Base class of every error fax_bridge raises on purpose."""


class PlacementError(_Located, FaxBridgeError, TypeError):
    """A value is used at a placement it does not have (e.g. CLIENTS where SERVER is
    needed); the message names the user's line."""


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


class ProgramError(_Located, FaxBridgeError, ValueError):
    """A program is declared wrongly: its placement name, its cardinality, or the
    placements given for its arguments; the message names the user's line."""


class SecureAggregationError(FaxBridgeError, ValueError):
    """A client value lies outside the range a secure aggregation was declared with."""


class HloModuleError(ComputationError):
    """An Xla computation's HloModuleProto is malformed: refused by the checks run before
    XLA reads it, or XLA died reading it (in a separate process, so the caller lives)."""


class UnbatchedWarning(RuntimeWarning):
    """Clients run one call each where fax_bridge would run them as one batched call (the
    message says which computation and why): the same results, at a loss of speed."""
