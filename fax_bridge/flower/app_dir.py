"""A Flower app directory for a round, as `flwr run DIR fax-bridge` runs it.

    DIR/pyproject.toml            [project], [tool.flwr.app] (components, run config)
    DIR/fax_round/server_app.py   app = fax_bridge.flower.server.server_app(here)
    DIR/fax_round/client_app.py   app = fax_bridge.flower.client.client_app(here)
    DIR/fax_round/round.json      the exported round and its initial state (`bundle`)
    DIR/fax_round/litert/         only with `litert`: the client part as a LiteRT model
                                  and its manifest (`<client part hash>.json`,
                                  `fax_bridge.litert.carried`), converted here, which
                                  SuperNodes with client-runtime="litert" run as it is
    DIR/README.md                 how to start the SuperLink and SuperNodes and run it
    DIR/initial_state.npz         a state over 64 kB (`bundle.state_in_bundle`), which
                                  only the ServerApp needs: read from the run config's
                                  `app-state` path, on the SuperLink's host
    DIR/.flwr/config.toml         the SuperLink connection `fax-bridge`
                                  (FLWR_HOME=DIR/.flwr; TLS with `root_certificates`)

Everything in the app bundle is a file type Flower ships (.py, .toml, .md, .json: so
the `.tflite` travels base64-encoded inside its JSON);
`.flwr/` is left out of bundles by Flower itself. fax_bridge and flwr must be installed
where the SuperLink and SuperNodes run; nothing is installed at run time.
"""

from __future__ import annotations

import os
import re
import shlex
from typing import Optional, Sequence, Union

from fax_bridge.system import output_folders
from fax_bridge.errors import ExportError
from fax_bridge.flower.bundle import (FILE_NAME, LITERT_DIR, MAX_BUNDLE_BYTES,
                                      FlowerRound, models_dir, state_in_bundle, write_round)
from fax_bridge.flower.server import RUN_CONFIG
from fax_bridge.flower.toml_text import (CONNECTION, connection_toml, node_config_text,
                                         toml_key, toml_string, toml_value)

PACKAGE = "fax_round"
STATE_FILE = "initial_state.npz"  # a state kept out of the bundle (bundle.write_state)

# The run config a written app declares: every key the ServerApp reads (`RUN_CONFIG`),
# at its default but for num-rounds, so that `flwr run --run-config` can set any of them
# (Flower refuses a key the app's pyproject.toml does not list).
DEFAULT_CONFIG = {**{key: spec.default for key, spec in RUN_CONFIG.items()},
                  "num-rounds": 3}

_SERVER = '''"""The ServerApp of this round (written by `fax-bridge flower`)."""

import os

from fax_bridge.flower.server import server_app

app = server_app(os.path.dirname(os.path.abspath(__file__)))
'''

_CLIENT = '''"""The ClientApp of this round (written by `fax-bridge flower`).

Flower starts a process for every message; `fax_bridge.flower.relay` is loaded by its
file, without the fax_bridge package (which loads jax), so that a SuperNode with a warm
worker answers without loading jax at all.
"""

import importlib.util
import os


def _relay():
    spec = importlib.util.find_spec("fax_bridge")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("fax_bridge is not installed where this SuperNode runs")
    path = os.path.join(list(spec.submodule_search_locations)[0], "flower", "relay.py")
    relay_spec = importlib.util.spec_from_file_location("fax_bridge_flower_relay", path)
    module = importlib.util.module_from_spec(relay_spec)
    relay_spec.loader.exec_module(module)
    return module


def _local():
    from fax_bridge.flower import client  # loads jax: only a node without a worker

    return client


app = _relay().client_app(os.path.dirname(os.path.abspath(__file__)), _local)
'''


def pyproject(name: str, config: dict) -> str:
    """The app's pyproject.toml."""
    lines = [
        "[project]", f"name = {toml_string(name)}", 'version = "1.0.0"',
        'description = "A fax_bridge round on Flower\'s Deployment Engine"',
        'license = "Apache-2.0"', "dependencies = []", "",
        "[tool.flwr.app]", 'publisher = "fax-bridge"', "",
        "[tool.flwr.app.components]", f'serverapp = "{PACKAGE}.server_app:app"',
        f'clientapp = "{PACKAGE}.client_app:app"', "", "[tool.flwr.app.config]"]
    lines += [f"{toml_key(k)} = {toml_value(v)}" for k, v in config.items()]
    return "\n".join(lines) + "\n"


def fenced(body: str) -> str:
    """`body` as a Markdown code block whose fence (CommonMark: a line of three or more
    backticks, closed by a line of at least as many) is longer than any run of backticks
    in it, so that a path holding backticks neither ends the block nor shows outside it."""
    runs = [len(run) for run in re.findall(r"`+", body)]
    fence = "`" * max([3] + [n + 1 for n in runs])
    return f"{fence}\n{body.rstrip(chr(10))}\n{fence}"


def command_blocks(text: str) -> list:
    """The bodies of the fenced code blocks of a README `readme` wrote, in order: each
    opened by a line of three or more backticks (and an optional info string) and closed
    by the next line of only backticks, at least as many."""
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        opening = re.match(r"(`{3,})[^`]*$", lines[i])
        i += 1
        if not opening:
            continue
        width, body = len(opening.group(1)), []
        while i < len(lines) and not re.fullmatch(r"`{%d,}" % width, lines[i].strip()):
            body.append(lines[i])
            i += 1
        i += 1
        blocks.append("\n".join(body) + "\n")
    return blocks


def node_starter(node: dict, node_security: str, superlink: str, port: int) -> str:
    """The one-line command (`fax_bridge.flower.supernode`) starting a warm SuperNode
    for the share `node` (a node config: population, first-client, ...)."""
    share = " ".join(f"--{key} {shlex.quote(str(value))}" for key, value in node.items())
    return (f"python -m fax_bridge.flower.supernode {node_security} --superlink "
            f"{shlex.quote(superlink)} --port {port} \\\n    {share} &")


def cold_starter(node: dict, node_security: str, superlink: str) -> str:
    """The command starting a plain `flower-supernode` (no warm worker) for the share
    `node`, its population in its `--node-config`."""
    return (f"flower-supernode {node_security} --superlink {shlex.quote(superlink)} "
            f"--port 9094 \\\n    --node-config {shlex.quote(node_config_text(node))} &")


def litert_section(node_security: str, superlink: str, nodes: list) -> str:
    """README's steps for SuperNodes that run the carried LiteRT model: each node's full
    command, warm and cold, with the LiteRT client runtime."""
    warm = "\n".join(node_starter(n, node_security, superlink, 9094 + i).removesuffix(" &")
                     + " --client-runtime litert &" for i, n in enumerate(nodes))
    cold = "\n".join(cold_starter(dict(n, **{"client-runtime": "litert"}), node_security,
                                  superlink) for n in nodes)
    return f"""
## LiteRT SuperNodes

This app carries the round's client part as a LiteRT model (`fax_round/{LITERT_DIR}/`,
converted by `fax-bridge flower ... --litert`). A SuperNode with the LiteRT client
runtime runs it in the LiteRT interpreter, as a phone would, and needs no converter
(only ai-edge-litert beside fax_bridge); a model of another round is refused by name.
Its manifest names each input and output by pytree path, as `fax-bridge litert` does
(`broadcast/<argument>/<path>`, `client/<argument>/<path>`,
`aggregate/<k>/value/<path>`, `aggregate/<k>/weight`).
Start the SuperLink as above, then these nodes instead of the XLA ones (warm):

{fenced(warm)}

or cold:

{fenced(cold)}
"""


def readme(made: FlowerRound, folder: str, superlink: str, nodes: list,
           root_certificates: Optional[str] = None, litert: bool = False) -> str:
    """DIR/README.md: what the app runs and the commands that run it (with TLS when
    `root_certificates`, the CA certificate, is given; every path and value quoted for
    the shell with `shlex.quote`); with `litert`, how to start SuperNodes that run the
    LiteRT model the app carries."""
    q = shlex.quote
    ca = root_certificates and os.path.abspath(root_certificates)
    node_security = "--insecure" if ca is None else f"--root-certificates {q(ca)}"
    link_security = "--insecure" if ca is None else (
        f"--ssl-ca-certfile {q(ca)} \\\n"
        "    --ssl-certfile SERVER.crt --ssl-keyfile SERVER.key")
    examples = nodes or [{"population": "/path/to/population", "first-client": 0}]
    node_lines = "\n".join(
        node_starter(n, node_security, superlink, 9094 + i)
        for i, n in enumerate(examples))
    cold = examples[0]
    app = os.path.abspath(folder)
    host, port = superlink.rsplit(":", 1)
    connection = "insecure" if ca is None else f"TLS, checked against {ca}"
    run_block = (f"export FLWR_TELEMETRY_ENABLED=0\n"
                 f"flower-superlink {link_security} --host {host} --port {port} \\\n"
                 f"    --disable-runtime-dependency-installation &\n{node_lines}\n"
                 f"FLWR_HOME={q(os.path.join(app, '.flwr'))} \\\n"
                 f"    flwr run {q(app)} {CONNECTION} --stream")
    return f"""# A fax_bridge round on Flower

Round: `{made.prepared.type}`

Written by `fax-bridge flower`. The ServerApp runs the round's server steps and merges
the SuperNodes' exact partials; each SuperNode runs the round's client part over the
clients of its own population (its `--node-config`), so no client's data leaves it.

## Run it

fax_bridge and flwr must be installed where these run (the same Python environment);
its `bin` folder must be on PATH, since Flower starts `flower-superexec` by name.

{fenced(run_block)}

The SuperLink installs each app it is sent under `~/.flwr/apps` (its own FLWR_HOME) and
runs it from there, so edits to this folder reach it only through the next `flwr run`.

`.flwr/config.toml` here names the SuperLink connection `{CONNECTION}` ({superlink},
{connection}). Settings (`[tool.flwr.app.config]` in pyproject.toml) can be overridden with
`--run-config 'num-rounds=10 out-dir="/tmp/out"'`: num-rounds; cohort-size (0: every
client), population-size (the clients the SuperNodes hold together, so that no node can
claim clients that do not exist; 0: not declared), dropout, seed, min-clients, round-deadline-s (0: none; else how long a round
waits for the nodes), node-timeout-s (the wait without a deadline),
first-round-timeout-s (the least the first round waits: nodes start then), min-nodes and
wait-nodes-s (SuperNodes to wait for), poll-s (the ServerApp's pull interval),
out-dir (reports.jsonl, one round's report a line, and result.npz), checkpoint-dir (resume after a crash) and
secagg-threshold (a round with secure sums: the fraction of nodes SecAgg+ needs left to
unmask a lost one; 0: a strict majority), app-state (a state over 64 kB is written
beside this app as {STATE_FILE} and named here, since the nodes never need it; copy it
to the SuperLink's host if that is another one and give its path: it must be that very
file, as its sha256 was recorded with the app), initial-state (an .npz of your own on
the SuperLink's host, `bundle.write_state`, to start from instead, e.g. a trained model:
each entry's dtype and shape must be the round's state's) and rounded-partials (true:
each node sends its float sums rounded once to float32, Flower's bytes, and the result
agrees with the exact one within that rounding instead of bit for bit; a node of one
client sends its exact float32 addend either way, and float16/bfloat16 sums travel
exact, to be rounded once).

Each `python -m fax_bridge.flower.supernode` line starts a warm SuperNode: a worker
that loads jax and compiles the round's client part once, on the node's loopback with a
private token, then Flower's own `flower-supernode` naming it; ending the command ends
both. Add `--auth-supernode-private-key KEY` with SuperNode authentication (below).

Cold SuperNodes (the slow path): Flower starts a process per message, so a SuperNode
started alone, its population in its `--node-config`, loads jax and compiles the
client part in every round's ClientApp process (tens of seconds a round):

{fenced(cold_starter(cold, node_security, superlink))}
{litert_section(node_security, superlink, examples) if litert else ""}
## Did it work?

`flwr run` exits 0 even when the ServerApp fails: read the run's `reports.jsonl` in
its out-dir (its last line's `error` is null when the round ended well; a round that
failed names the reason there, and in the ServerApp's log that `--stream` shows), or
let `fax-bridge flower ... --check` run and compare the rounds (it exits non-zero on any
failure or mismatch).

A SuperNode's `--node-config`: `population` (a directory written by
`fax_bridge.data.write_population`), `first-client` (the population id of its first
client), `num-clients`, `first-row` (its first client's row in the store) and `keys`
(the stored array of each tensor of the client data, comma-separated). The nodes'
blocks must together be clients 0..N-1.

## Security

TLS (`fax-bridge flower --root-certificates CA` writes the commands above with it):
the SuperLink serves with `--ssl-ca-certfile CA --ssl-certfile SERVER.crt
--ssl-keyfile SERVER.key` (a certificate for the SuperLink's host signed by CA), each
SuperNode checks it with `--root-certificates CA` instead of `--insecure`, and
`.flwr/config.toml` names `root-certificates = "CA"` instead of `insecure = true`.

SuperNode authentication (needs TLS): start the SuperLink with `--enable-supernode-auth`
as well, make an EC key pair per SuperNode (NIST P-256, OpenSSH format, e.g.
`ssh-keygen -t ecdsa -b 256 -N "" -f node-0`), register each public key before its node
starts (`FLWR_HOME=DIR/.flwr flwr supernode register node-0.pub {CONNECTION}`) and start
the node with `--auth-supernode-private-key node-0`. The SuperLink refuses a SuperNode
whose key is not registered (the node exits: "Failed to activate SuperNode").
"""


def litert_models(made: FlowerRound) -> list:
    """The round's client part converted to a LiteRT model, packed for the app
    (`carried.pack`); a client part that cannot convert is refused here, naming the op
    (`refusals.ConversionRefused`), and a model too large for an app bundle too."""
    from fax_bridge.litert import carried

    packed = [carried.pack(made.split, str(made.prepared.type), made.aggregands,
                           made.argument_names)]
    size = sum(len(text) for _, text in packed)
    if size > MAX_BUNDLE_BYTES:
        raise ExportError(
            f"the LiteRT model takes {size} bytes in the app, over the {MAX_BUNDLE_BYTES} "
            "bytes a Flower app bundle may hold; write the app without --litert (each "
            "LiteRT node then converts the model itself)")
    return packed


KIND = "flower app"  # this app's entries in the folder's record (`output_folders`)
# The entries every app writes (`write_app`), checked before a round is built or
# converted (`check_folder`); the LiteRT models and a state kept beside the app are
# checked when the app is placed.
FILES = ("pyproject.toml", "README.md", ".flwr/config.toml", f"{PACKAGE}/__init__.py",
         f"{PACKAGE}/server_app.py", f"{PACKAGE}/client_app.py", f"{PACKAGE}/{FILE_NAME}")


def check_folder(folder: str, *, force: bool = False, reserve: Sequence[str] = ()) -> None:
    """Refuses, before any round is built, an app folder whose files `write_app` would
    refuse to replace (`output_folders.check_entries`, the same text)."""
    output_folders.check_entries(folder, list(FILES) + list(reserve), force=force,
                                 what="the app folder")


def write_app(made: FlowerRound, folder: str, *, superlink: str = "127.0.0.1:9093",
              config: Optional[dict] = None, nodes: Optional[list] = None,
              name: str = "fax-bridge-round",
              root_certificates: Optional[str] = None,
              litert: Union[bool, list] = False, force: bool = False,
              reserve: Sequence[str] = ()) -> list:
    """Writes the app directory (module docstring); returns the paths written.

    The folder may hold other files: the app's replace only what fax_bridge wrote there
    before, and one that is not is refused by name (`output_folders.place`) unless
    `force`; files of an earlier app this one no longer has are removed.

    Args:
      made: the round (`bundle.build_round`).
      folder: the app directory.
      superlink: HOST:PORT of the SuperLink (checked: `addresses.parse_address`).
      config: run config values over `DEFAULT_CONFIG`.
      nodes: the SuperNodes' node configs README's commands start.
      name: the app's name in pyproject.toml.
      root_certificates: a CA certificate: the connection and README use TLS.
      litert: True, or `litert_models`' list made beforehand: the app carries the
        client part as a LiteRT model, converted before anything is written.
      force: replace files fax_bridge did not write.
      reserve: entries (relative, a folder ending in `/`) the caller writes into the
        folder afterwards, claimed and recorded with the app's.

    Returns:
      The paths written, in the folder.
    """
    from fax_bridge.system.addresses import normalized

    superlink = normalized(superlink, "the SuperLink address")
    packed = litert_models(made) if litert is True else list(litert or [])
    settings = dict(DEFAULT_CONFIG)
    settings["out-dir"] = os.path.join(os.path.abspath(folder), "results")
    settings.update(config or {})
    state_path = os.path.join(os.path.abspath(folder), STATE_FILE)
    placed: list = []
    with output_folders.staged(folder, KIND, force=force, reserve=reserve,
                               what="the app folder", placed=placed) as stage:
        package = os.path.join(stage, PACKAGE)
        written = False
        if state_in_bundle(made):
            try:
                write_round(made, package, models=packed)
                written = True
            except ExportError:  # the round with it over the bundle's 10 MB
                pass
        if not written:  # beside the app: only the ServerApp reads it
            write_round(made, package, os.path.join(stage, STATE_FILE), models=packed)
            settings["app-state"] = state_path
        if packed:
            from fax_bridge.litert import carried

            carried.write(models_dir(package), packed)
        files = {
            "pyproject.toml": pyproject(name, settings),
            os.path.join(PACKAGE, "__init__.py"):
                '"""A fax_bridge round as a Flower app."""\n',
            os.path.join(PACKAGE, "server_app.py"): _SERVER,
            os.path.join(PACKAGE, "client_app.py"): _CLIENT,
            "README.md": readme(made, folder, superlink, nodes or [], root_certificates,
                                bool(packed)),
            os.path.join(".flwr", "config.toml"): connection_toml(
                superlink, root_certificates=root_certificates),
        }
        for path, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(stage, path)), exist_ok=True)
            with open(os.path.join(stage, path), "w", encoding="utf-8") as f:
                f.write(text)
    reserved = {os.path.join(folder, *r.rstrip("/").split("/")) for r in reserve}
    return [path for path in placed if path not in reserved]
