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
	$(BIN)/ruff check gpurelay edge_agent cloud_gateway tests bench deploy
	$(BIN)/ruff format --check gpurelay edge_agent cloud_gateway tests bench deploy

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest -q -ra

test: lint typecheck unit

# Gateway (SSH :2222, HTTP :9410) and one agent (:9400) on loopback, dev certs in certs/dev.
demo: $(STAMP)
	$(BIN)/python deploy/dev/demo.py

bench: $(STAMP)
	$(BIN)/python bench/agent_cycle.py
	$(BIN)/python bench/wire_size.py
	$(BIN)/python bench/gateway_render.py
	$(BIN)/python bench/gateway_ingest.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache *.egg-info
