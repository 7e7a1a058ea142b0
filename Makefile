# The README's two commands: `make serve` runs trnd on its embedded default, `make test` passes the tests.
# Each makes its own virtual environment on a fresh machine. torch is pinned to 2.13.0: that CPU build is
# on local disk here; an unpinned torch pulls a multi-GB CUDA build.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: serve test test-fast venv clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $@

venv: $(BIN)/.installed

serve: venv
	$(BIN)/trnd serve $(ARGS)

test: venv
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-fast: venv
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
