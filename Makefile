# megatron-splitkv: `make test` (CPU test suite) and `make demo` (the main job on a small default).
# The virtual environment is built from scratch when missing, with a Python >= 3.12 found on PATH or
# under pyenv (megatron-core 0.19 requires 3.12).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON_BOOT ?= $(shell for p in python3.13 python3.12; do command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { command -v $$p; exit 0; }; done; \
	r=$$(pyenv root 2>/dev/null || echo $$HOME/.pyenv); ls -d $$r/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -V | head -1)
PYTEST_ARGS ?=
# pytest-xdist worker processes of `make test` (0: one process). --dist loadfile keeps a test file's tests on one
# worker, so a file's module-scoped fixtures (one gloo spawn serving many cases) run once, not once per worker;
# --no-loadscope-reorder hands the files out in collection order, which tests/conftest.py starts with the slowest.
PYTEST_WORKERS ?= 2

.PHONY: venv test demo clean-venv

$(VENV)/.installed: setup.py requirements.txt
	@test -n "$(PYTHON_BOOT)" || { echo "error: no Python >= 3.12 found (looked on PATH and under pyenv)"; exit 1; }
	@echo "building $(VENV) with $(PYTHON_BOOT)"
	$(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps dflash==0.1.0
	$(PY) -m pip install -q --no-deps -e .
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder tests $(PYTEST_ARGS)

demo: venv
	$(PY) examples/train_demo.py

clean-venv:
	rm -rf $(VENV)
