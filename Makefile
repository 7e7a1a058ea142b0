# The README's two commands: `make serve` runs trnd on its embedded default, `make test` passes the tests.
# Each makes its own virtual environment on a fresh machine. torch is pinned to 2.13.0: that CPU build is
# on local disk here; an unpinned torch pulls a multi-GB CUDA build.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=
# Most of the suite's time is tests waiting on the real processes they start (imports, handshakes,
# deadlines), so two workers overlap those even on two cores: 15:42 against 23:23 for the whole suite here.
# --dist loadfile keeps each file on one worker, so a module fixture (a booted systemd, a compile cache) is
# made once. TEST_JOBS=0 runs it in this process, one test at a time.
TEST_JOBS ?= 2

.PHONY: serve test test-unit test-procs test-system test-kernels test-fast venv clean

# The editable install runs the package build (setup.py's build_kernels: the compiled CPU kernels, as in the
# wheel), here against the venv's torch rather than a second copy of it in an isolated build environment.
$(BIN)/.installed: pyproject.toml setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 'setuptools>=77' ninja
	$(BIN)/pip install -q --no-build-isolation -e '.[test]'
	touch $@

# After csrc/ changes: the same build again (ninja recompiles what changed), never at request time.
KERNELS := kernels/cpu/build/.built
$(KERNELS): $(BIN)/.installed $(wildcard kernels/cpu/csrc/*) kernels/cpu/build.py
	$(BIN)/python -m trnd_kernels.cpu.build
	touch $@

venv: $(BIN)/.installed $(KERNELS)

serve: venv
	$(BIN)/trnd serve $(ARGS)

test: venv
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile $(PYTEST_ARGS)

# The layers (README, "Tests"): unit first, in about a minute; then what the change touched.
test-unit: venv
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile -m "not slow" tests/unit $(PYTEST_ARGS)

test-procs: venv
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile tests/procs $(PYTEST_ARGS)

test-system: venv
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile tests/system $(PYTEST_ARGS)

test-kernels: venv
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile tests/kernels $(PYTEST_ARGS)

test-fast: venv
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis kernels/cpu/build
