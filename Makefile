# `make demo` and `make test` set everything up on a fresh machine (Python 3.11 required).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build from the local wheel cache; set TORCH_SPEC="torch" (or a CUDA build) on a GPU machine.
TORCH_SPEC ?= torch==2.13.0
PEERS ?= 3
ROUNDS ?= 5

.PHONY: install demo test test-deps bench clean

install: $(VENV)/.installed

# Nothing is byte-compiled at install: the first process to import a module writes its bytecode, and every later
# one reads it. Where PYTHONDONTWRITEBYTECODE is set (as in some CI shells) no process would ever write it, and each
# would compile torch's modules again: so our recipes run without it. Compiling the whole venv up front (compileall,
# or pip's own) costs more than it saves: the suite and the demo import a tenth of its files (BENCHMARKS.md,
# "Leaving and installing").
unexport PYTHONDONTWRITEBYTECODE

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --no-compile -e ".[test]"
	touch $@

demo: install
	$(VENV)/bin/diloco-peer demo --peers $(PEERS) --rounds $(ROUNDS) --out runs/demo

test: install test-deps
	$(PY) tests/lanes.py

# Every benchmark's quick mode (about a minute each; the network ones need root for namespaces), then the
# tables of BENCHMARKS.md from bench/results.json. Full modes: run each script without --quick.
BENCHES := utilization bytes_per_token allreduce_efficiency daemon_overhead vs_hivemind_optimizer gpu
bench: install
	@for b in $(BENCHES); do echo "== bench/$$b.py --quick"; $(PY) bench/$$b.py --quick || exit 1; done
	$(PY) bench/report.py

# Debian tools the tests use: prometheus (+ promtool) scrapes a test swarm and lints the metrics,
# docker-compose validates docker-compose.yml, iptables + iproute2 emulate home routers (NAT).
# Installed when missing (needs root and Debian's registry).
DEBIAN_TEST_TOOLS := prometheus:prometheus promtool:prometheus docker-compose:docker-compose iptables:iptables \
	ip:iproute2 tc:iproute2
test-deps:
	@missing=""; for pair in $(DEBIAN_TEST_TOOLS); do command -v $${pair%%:*} >/dev/null 2>&1 || \
		missing="$$missing $${pair##*:}"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages for the tests:$$missing"; \
		(apt-get install -y -qq $$missing >/dev/null 2>&1 || \
		 (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq $$missing >/dev/null 2>&1)) || \
		echo "warning: could not install$$missing; the tests that need them will be skipped"; \
	fi

clean:
	rm -rf $(VENV) runs *.egg-info .pytest_cache
