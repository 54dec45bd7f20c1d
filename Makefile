# edge-gpu-relay — two commands for a newcomer: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: test lint typecheck unit demo bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check edge_agent cloud_gateway tests bench
	$(BIN)/ruff format --check edge_agent cloud_gateway tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest -q -ra

test: lint typecheck unit

# The agent with 2 simulated GPUs (MIG on GPU 0) serving http://127.0.0.1:9400.
demo: $(STAMP)
	$(BIN)/edge-agent run --simulate 2 --simulate-mig --interval 2 $(DEMO_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/agent_cycle.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache *.egg-info
