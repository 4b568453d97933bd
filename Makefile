# Everything runs from a venv this Makefile creates, so a fresh clone needs nothing but python3.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test run bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0   # CPU build; an unpinned torch pulls a CUDA build of several GB
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=30 tests

run: $(STAMP)
	$(BIN)/python jobs/offline_eval.py $(ARGS)

clean:
	rm -rf $(VENV)
