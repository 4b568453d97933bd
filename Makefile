# Everything runs from a venv this Makefile creates, so a fresh clone needs nothing but python3.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test run bench clean

# uv installs the rest faster than pip (the same packages). torch stays with pip, which reads
# this machine's pip config (where the CPU wheel is found); uv reads none, and keeps the torch
# it finds installed. --compile-bytecode: uv writes no .pyc by default, and with
# PYTHONDONTWRITEBYTECODE=1 (set on these machines) every Ray worker then compiles ray and
# ray.data from source: `import ray, ray.data` measured 6.6 CPU-s instead of 1.9, per process.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0 uv   # CPU build; an unpinned torch pulls a CUDA build of several GB
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -e '.[test,bench]'
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=30 tests

run: $(STAMP)
	$(BIN)/python jobs/offline_eval.py $(ARGS)

clean:
	rm -rf $(VENV)
