# fax_bridge developer entry points. `make test` and `make demo` work from a fresh clone
# with Python 3.12 and 3.11: they build .venv on 3.12 with the newest jax of the range
# (tools/jax/newest.txt), and the side venvs on 3.11 (.venv-tff for the TFF 0.87 checks,
# .venv-litert for the LiteRT converter). `make test-peers` runs the core tests again on
# the oldest jax (tools/jax/oldest.txt) and Python 3.11, in .venv-oldest.
# PYTHON: the first Python 3.12 that runs (a pyenv shim on PATH runs only where pyenv
# selects 3.12, so pyenv's own 3.12 is tried next); PYTHON=... picks another.
PYTHON ?= $(shell for p in python3.12 "$$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12); print(sys.executable)' 2>/dev/null && break; done)
OLDEST_PYTHON ?= $(shell command -v python3.11)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OLDEST_VENV := .venv-oldest
OLDEST_STAMP := $(OLDEST_VENV)/.installed
TFF_OUT := out/tff

.PHONY: venv test test-peers test-oldest doctest demo protos tff-venv litert-venv bench-litert tff-check forms-check fuzz bench bench-scaling bench-flower bench-sizes bench-links bench-accel clean

# Installs skip byte-compiling every module of every package (--no-compile): Python
# compiles the ones a run imports, as it first imports them (a quarter to a third of the
# three venvs' build), and later processes read them compiled. So a caller's
# PYTHONDONTWRITEBYTECODE is not passed on: with it every process (the test workers,
# each fleet device, Flower node and TensorFlow side process) compiled jax, TensorFlow
# and the rest again from source (test_fleet_remote and test_forks: 48 s with it, 34 s
# without, once compiled).
unexport PYTHONDONTWRITEBYTECODE
venv: $(STAMP)

$(STAMP): pyproject.toml tools/jax/newest.txt
	@test -n "$(PYTHON)" || { echo "make: no Python 3.12 found; install it or pass PYTHON=/path/to/python3.12" >&2; exit 2; }
	$(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install --quiet --no-compile -e '.[test]' -c tools/jax/newest.txt
	touch $(STAMP)

# The oldest jax of the range on Python 3.11 (make test-peers' core tests).
$(OLDEST_STAMP): pyproject.toml tools/jax/oldest.txt
	@test -n "$(OLDEST_PYTHON)" || { echo "make: no python3.11 found; install it or pass OLDEST_PYTHON=/path/to/python3.11" >&2; exit 2; }
	$(OLDEST_PYTHON) -m venv --clear $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install --quiet --no-compile -e '.[test]' -c tools/jax/oldest.txt
	touch $(OLDEST_STAMP)

# Generated gRPC modules are committed; this regenerates them (a test checks they match).
protos: $(STAMP)
	$(PY) tools/gen_protos.py

tff-venv:
	tools/tff087/setup.sh

# litert-converter 0.5.0 in .venv-litert (it cannot share .venv with Flower: docs/litert.md).
litert-venv:
	tools/litert/setup.sh

# Every example exported, then read back by TensorFlow Federated 0.87 itself, which must
# see the same type signatures as federated_language (and the TFF-written test data too).
tff-check: $(STAMP) tff-venv
	$(PY) tools/tff_check.py --pb-dir $(TFF_OUT) --pb-dir tests/data/tff087 \
		--generate "$(PY) tools/export_examples.py --out {pb_dir}"

# Every single-round program as TFF's DistributeAggregateForm and MapReduceForm, built by
# TFF 0.87, run piece by piece (runtime, fleet, TF sessions) and compared with jax.jit.
forms-check: $(STAMP) tff-venv
	$(PY) tools/forms_check.py --out out/forms

# The venvs (.venv, .venv-tff, .venv-litert) build two at a time (each half waits on the
# network or on one core); TFF 0.87 reads every exported example back (tff-check; the
# production forms built and run piece by piece, forms-check, are make test-peers');
# pytest runs on three workers, a test file to a worker so that
# module-scoped fixtures (a Flower deployment, a fleet) start once, the longest files
# first (`LONGEST_FIRST` in tests/conftest.py), and the docstrings' examples run in the
# same session (`make doctest` runs them alone). Three workers on two cores: a worker
# waiting on its device processes, a socket or a round's deadline leaves its core to
# the others (the suite took 450 s so on the shared 2-core machine, 525 s on two).
test:
	$(MAKE) -j2 $(STAMP) tff-venv litert-venv
	$(MAKE) tff-check
	$(PY) -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder tests --doctest-modules $(DOCTEST_MODULES)

# The production forms of every single-round program built by TFF 0.87 and run piece by
# piece (forms-check), then the comparisons with the peers, each in its own venv
# (google-fax 0.0.2 on jax 0.4.26,
# TFF 0.87, Flower's simulation engine): one round of each peer against the numpy
# reference, google-fax's gradient against ours, Flower's large workload and model
# sizes; the link benchmark's fax_bridge run and the parity, TLS, SecAgg+ and killed-node
# checks on a loopback Flower deployment; the benchmarks' end-to-end runs. `make test`
# deselects them (marker `peers`); CI runs this after it. The venvs
# are cached like .venv-tff (rebuilt when their package lists change). Then the core
# tests (CORE_TESTS: where jax versions differ) on the oldest jax
# of the range and Python 3.11, in .venv-oldest.
test-peers: $(STAMP) tff-venv $(OLDEST_STAMP)
	$(MAKE) forms-check
	benchmarks/peers/setup_venvs.sh fax
	benchmarks/peers/setup_venvs.sh flower
	$(PY) -m pytest -q -n 2 --dist loadfile --peers -m peers tests
	$(MAKE) test-oldest

# The core tests on the oldest jax of the range (tools/jax/oldest.txt), Python 3.11;
# the TFF forms' and LiteRT refusals' tests read .venv-tff and .venv-litert too.
CORE_TESTS := $(addprefix tests/test_,jax_compat.py tracing.py primitives.py secure.py \
	chunking.py chunk_stream.py runtime_hlo.py runtime_hlo_lax.py runtime_client_map.py \
	parity_shadow.py tff_xla.py tff_export.py litert_refusals.py builtin_rewrites.py)
test-oldest: $(OLDEST_STAMP) tff-venv litert-venv
	$(OLDEST_VENV)/bin/python -m pytest -q -n 2 --dist loadfile $(CORE_TESTS)

# The examples in the public functions' docstrings (a few clients each: seconds).
DOCTEST_MODULES := fax_bridge/api.py fax_bridge/local/jit.py fax_bridge/local/chunk_stream.py fax_bridge/language/tracing.py \
	fax_bridge/tff/export.py fax_bridge/tff/files.py fax_bridge/language/secure.py \
	fax_bridge/parity/check.py fax_bridge/in_process.py fax_bridge/data \
	fax_bridge/privacy/aggregator.py fax_bridge/algorithms/evaluation.py
doctest: $(STAMP)
	$(PY) -m pytest -q --doctest-modules $(DOCTEST_MODULES)

demo: $(STAMP)
	$(PY) examples/quickstart.py

# The long hypothesis run over the proto interpreter (sharing-heavy protos included) and
# the device RPCs (13,200 cases), mutated HLO modules through run_computation and a
# device's Load (2 x 2,600, crashes detected in worker processes: tools/hlo_fuzz.py), then
# request floods against a device process with its memory, descriptors and answer times
# measured (tools/device_flood.py).
fuzz: $(STAMP)
	$(PY) tools/fuzz.py --cases 2200

# fax_bridge (local and fleet) against google-fax, TFF 0.87 and Flower, each peer in its
# own venv; a peer whose venv cannot be built is reported as skipped. Then the model-size
# sweep: four models, 10k to 10M parameters, jit (fax_bridge, hand-written, DrJAX), the
# exported round in process and on a LocalFleet, and Flower's simulation on the linear model.
bench: $(STAMP)
	benchmarks/peers/setup_venvs.sh all || echo "bench: some peer venvs could not be built; they are reported as skipped"
	$(PY) benchmarks/bench.py --workload both --repeats 3 --json out/bench/bench.json --log-dir out/bench/logs
	$(PY) benchmarks/model_sizes.py --paths runtime fleet --flower --json out/bench/model_sizes.json \
		--plot docs/img/model_sizes.png

bench-scaling: $(STAMP)
	$(PY) benchmarks/scaling.py --clients 1000 10000 100000 --devices 1 2 4 --both --out out/scaling.json

# The peers' digits FedAvg rounds on Flower's Deployment Engine (a SuperLink and two
# SuperNodes on loopback): fax_bridge's Flower app beside Flower's own NumPy FedAvg app,
# and a LocalFleet for scale (docs/benchmarks.md).
bench-flower: $(STAMP)
	$(PY) benchmarks/flower_rounds.py --rounds 6 --repeats 2 --json out/bench/flower_rounds.json

# fax_bridge's Flower app beside Flower's own NumPy FedAvg app on shaped links: the SuperLink
# and each SuperNode in network namespaces of their own joined by veth pairs (tc tbf: 20
# Mbit/s up and 100 down, then 100/1000), TLS on, 1M and 10M parameters, a cohort of one
# client a node and of two; then the faults (a cut link, a 1 Mbit/s straggler, a SuperLink
# restart); and the gRPC fleet's coordinator and devices on such hosts (mutual TLS). Needs
# root, `ip netns` and `tc` (docs/links.md).
bench-links: $(STAMP)
	$(PY) benchmarks/links.py --json out/bench/links.json
	$(PY) benchmarks/links.py --faults --json out/bench/links_faults.json
	$(PY) benchmarks/links_fleet.py --json out/bench/links_fleet.json

# One FedAvg round per model size (four models, 10k to 10M parameters, four aggregations):
# fax_bridge under jax.jit against hand-written jit(vmap) and DrJAX 0.2.1; a table,
# out/model_sizes.json and the plot docs/img/model_sizes.png (`--quick`: smallest sizes).
bench-sizes: $(STAMP)
	$(PY) benchmarks/model_sizes.py --json out/model_sizes.json --plot docs/img/model_sizes.png

# Rounds' client parts as LiteRT models: which algorithms convert (max error against the
# stated bound), model sizes 100k-10M, client-step time against jit, a LiteRT device's
# memory, a fleet round with LiteRT devices against XLA ones (docs/litert.md).
bench-litert: $(STAMP) litert-venv
	$(PY) benchmarks/litert_sizes.py --json out/bench/litert.json

# FedAvg rounds of a decoder LM (34M-268M parameters) on whatever jax.devices() offers,
# in one process: jit, hand-written, DrJAX, chunked cohorts, the exported round in process
# (docs/accelerators.md). Install jax for the accelerator in .venv first.
bench-accel: $(STAMP)
	$(PY) benchmarks/accelerators.py --suite --json out/bench/accel.jsonl

clean:
	rm -rf $(VENV) $(OLDEST_VENV) .venv-tff .venv-litert .venv-fax .venv-flower build *.egg-info .pytest_cache out
