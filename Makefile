# One command each, from a fresh clone: `make demo`, `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev

.PHONY: demo test lint typecheck bench venv clean

# The venv is (re)installed when pyproject.toml changes. torch==2.13.0 resolves to the
# CPU wheel available locally; `pip check` fails the setup on any broken pin.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip check
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/thundersync demo --out runs/demo
	$(BIN)/python benchmarks/grpo_release_tail.py --groups 4 --group-size 6 \
		--prompt-tokens 128 --response-tokens 192

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/grpo_release_tail.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .mypy_cache
