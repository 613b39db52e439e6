# The README's commands. Each creates .venv if absent and installs the project into it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench bench-quick clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	@$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	@touch $@

demo: $(STAMP)
	$(PY) -m examples.demo

# The benchmarks (bench/, docs/benchmarks.md) need matplotlib for the chart: the bench extra.
BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): pyproject.toml $(STAMP)
	@$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,bench]'
	@touch $@

bench: $(BENCH_STAMP)
	$(PY) -m bench $(BENCH_ARGS)

bench-quick: $(BENCH_STAMP)
	$(PY) -m bench --quick $(BENCH_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check keyqueue tests
	$(PY) -m mypy keyqueue

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
