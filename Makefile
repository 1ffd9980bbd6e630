# Two entry points (see README):
#   make serve   set up .venv and serve the embedded default model with an INT2 KV cache (GPU)
#   make test    set up .venv and run the test suite (CPU is enough)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: test serve venv clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,calib]'
	touch $@

venv: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

serve: $(VENV)/.installed
	$(VENV)/bin/oscar-sglang serve

clean:
	rm -rf $(VENV)
