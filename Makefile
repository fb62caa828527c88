# `make demo` and `make test` set everything up on a fresh machine (Python 3.11 required).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build from the local wheel cache; set TORCH_SPEC="torch" (or a CUDA build) on a GPU machine.
TORCH_SPEC ?= torch==2.13.0
PEERS ?= 3
ROUNDS ?= 5

.PHONY: install demo test clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

demo: install
	$(VENV)/bin/diloco-peer demo --peers $(PEERS) --rounds $(ROUNDS) --out runs/demo

test: install
	$(PY) -m pytest -q --durations=10

clean:
	rm -rf $(VENV) runs *.egg-info .pytest_cache
