"""The example clients of a round as SuperNodes' populations: `FOLDER/node-K`, one per
SuperNode, contiguous blocks of clients (`data.partition.contiguous_blocks`).

`plan` checks the client data and returns each SuperNode's node config without writing;
`write_populations` writes them through `output_folders.staged`: each `node-K/` is one
entry of the folder's record, written in a staging folder and moved in only once every
population is written, so a failure leaves the folder as it was; other files in FOLDER
are kept, and one where a `node-K` goes that fax_bridge did not write is refused by name
unless `force`. A `node-K` of an earlier write with more nodes is removed."""

from __future__ import annotations

import os

import numpy as np

from fax_bridge.system import output_folders
from fax_bridge.errors import FleetError

KIND = "populations"  # their entries in the folder's record


def _columns(data) -> dict:
    """The client data as {key: array (clients, examples, ...)}, refused by name when a
    population cannot store it."""
    if isinstance(data, dict):
        columns = {str(k): np.asarray(v) for k, v in data.items()}
    elif hasattr(data, "shape"):
        columns = {"data": np.asarray(data)}
    else:
        raise FleetError(
            f"the SuperNodes' populations are written from client data that is a dict of "
            f"arrays or one array, not {type(data).__name__}; write the populations with "
            "fax_bridge.data.write_population and pass keys= in the node config")
    if not columns:
        raise FleetError("the client data holds no arrays to write as populations")
    count = len(next(iter(columns.values())))
    for key, column in columns.items():
        if column.ndim < 2 or len(column) != count:
            raise FleetError(
                f"client data {key!r} has shape {list(column.shape)}: a SuperNode's "
                f"population stores examples, so every array needs the {count} clients "
                "first, then an example axis (clients, examples, ...); a value per client "
                "(a per-client weight) has none. Give it one row per example (e.g. "
                "np.repeat(w[:, None], examples, axis=1), and read w[0] in the client "
                "part), or keep it in the server state (see docs/flower.md)")
    examples = {key: column.shape[1] for key, column in columns.items()}
    if len(set(examples.values())) > 1:
        raise FleetError(f"client data arrays hold different numbers of examples per client "
                         f"{examples}; a population's arrays hold one row per example each, "
                         "so give them the same second dimension")
    return columns


def _blocks(columns: dict, nodes: int) -> list:
    from fax_bridge.data.partition import contiguous_blocks

    count = len(next(iter(columns.values())))
    if not 1 <= nodes <= count:
        raise FleetError(f"{nodes} SuperNodes for {count} example clients: give 1..{count} "
                         "nodes (--nodes, or devices= in check_parity)")
    return list(contiguous_blocks(count, nodes))


def plan(data, folder: str, nodes: int) -> list:
    """Each SuperNode's node config (population folder, first client) `write_populations`
    would write; refuses client data a population cannot store (`_columns`), before
    anything is written."""
    final = os.path.abspath(folder)
    return [{"population": os.path.join(final, f"node-{k}"), "first-client": block.start}
            for k, block in enumerate(_blocks(_columns(data), nodes))]


def write_populations(data, folder: str, nodes: int, *, force: bool = False) -> list:
    """Writes the example clients (a dict of arrays with a leading clients axis, or one
    array) as `nodes` populations (module docstring); returns each SuperNode's node
    config.

    A population stores examples: every array needs an example axis after the clients
    axis (shape (clients, examples, ...)); an array of one value per client (a
    per-client weight of shape (clients,)) is refused before anything is written,
    naming it and the fix."""
    from fax_bridge.data import write_population

    columns = _columns(data)
    blocks = _blocks(columns, nodes)
    names = [f"node-{k}" for k in range(len(blocks))]
    with output_folders.staged(folder, KIND, force=force, whole=names,
                               what="the population folder") as stage:
        for name, block in zip(names, blocks):
            write_population(os.path.join(stage, name),
                             ({key: col[i] for key, col in columns.items()} for i in block))
    return plan(data, folder, nodes)
