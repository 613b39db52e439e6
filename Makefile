# The README's commands. Each creates .venv if absent and installs the project into it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint java-check chromium-check bench bench-quick bench-spark chaos chaos-cluster clean

# keyqueue's own plugins, each a distribution of its own (OpenTelemetry, Spark, the Rebaser).
PLUGINS := plugins/keyqueue_otel plugins/keyqueue_spark contrib/rebaser

$(STAMP): pyproject.toml $(PLUGINS:%=%/pyproject.toml)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	@$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]' $(PLUGINS:%=-e %)
	@touch $@

demo: $(STAMP)
	$(PY) -m examples.rebaser

# The benchmarks (bench/, docs/benchmarks.md) need matplotlib for the chart: the bench extra.
BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): pyproject.toml $(STAMP)
	@$(PY) -m pip install -q --disable-pip-version-check -e '.[dev,bench]'
	@touch $@

bench: $(BENCH_STAMP)
	$(PY) -m bench $(BENCH_ARGS)

bench-quick: $(BENCH_STAMP)
	$(PY) -m bench --quick $(BENCH_ARGS)

# keyqueue on Spark (docs/benchmarks.md): a backfill and a report over a million, ~20 min.
bench-spark: $(BENCH_STAMP) java-check
	$(PY) -m bench.spark $(BENCH_ARGS)

# The full soak (docs/chaos.md): 500 faults of every class, then the checker's verdict.
CHAOS_ARGS ?= --seed 7 --faults 500 --duration 1200

chaos: $(STAMP)
	$(PY) -m keyqueue.chaos $(CHAOS_ARGS)

# The cluster soak (docs/chaos.md): 1,000 faults of every class at once on a 3-node R3 cluster, with every
# handler shape users write (async, thread, process pool, GIL-holding, loop-blocking) and bad input.
CHAOS_CLUSTER_ARGS ?= --seed 7 --faults 1000 --classes all --handlers all --rss-limit 0.10 --duration 3600 --workdir chaos-cluster-run

chaos-cluster: $(STAMP)
	$(PY) -m keyqueue.chaos $(CHAOS_CLUSTER_ARGS)

# One process by default (CI's run). `make test TEST_WORKERS=2` runs the suite in 2 processes
# (pytest-xdist: each test file on one of them, the Spark tests on one with their JVM), then the
# tests marked serial (the soaks, the browser tests) alone: about 20 minutes against 23 on 2 cores
# (docs/decisions.md, "The suite in parallel processes: an option, not the default").
#
# The project's modules are compiled first: where PYTHONDONTWRITEBYTECODE is set, each of the suite's
# hundreds of `keyqueue worker` and CLI processes would otherwise compile keyqueue again (0.7 s of CPU
# each on 2 cores; docs/decisions.md, "The suite's processes start from compiled modules").
TEST_WORKERS ?= 1
test: $(STAMP) java-check chromium-check
	@$(PY) -m compileall -q -j 0 keyqueue plugins contrib examples bench tests >/dev/null
ifeq ($(TEST_WORKERS),1)
	$(PY) -m pytest -q
else
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not serial"
	$(PY) -m pytest -q -m serial
endif

# Strict mypy over all of the unit tests (their fakes of the core's I/O seams, keyqueue/core/key_io.py, are
# checked against them) and the benchmarks; its settings, stubs and the modules it cannot see: pyproject.toml.
lint: $(STAMP)
	$(PY) -m ruff check keyqueue plugins contrib tests bench
	$(PY) -m mypy keyqueue plugins contrib tests/typed_usage.py tests/unit bench

# Spark (keyqueue-spark: tests/spark, keyqueue report / backfill, examples/spark) needs Java 17+.
# Without it, install Debian's headless JRE (as root, or with sudo).
JAVA_MIN := 17
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

java-check:
	@v=$$(java -version 2>&1 | sed -n 's/.*version "\([0-9][0-9]*\).*/\1/p' | head -n 1); \
	if [ -n "$$v" ] && [ "$$v" -ge $(JAVA_MIN) ]; then exit 0; fi; \
	echo "java-check: Spark needs Java $(JAVA_MIN)+, found $${v:-no java}; installing openjdk-17-jre-headless (apt-get) ..."; \
	if command -v apt-get >/dev/null 2>&1 && $(SUDO) apt-get update -qq \
	   && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq openjdk-17-jre-headless >/dev/null; then \
	  echo "java-check: installed $$(java -version 2>&1 | head -n 1)"; \
	else \
	  echo "java-check: ERROR: could not install Java $(JAVA_MIN). Install a JRE $(JAVA_MIN)+ (e.g. apt-get install" \
	       "openjdk-17-jre-headless) and put java on PATH, or set JAVA_HOME; then run make again." >&2; \
	  exit 1; \
	fi

# The dashboard's browser tests (tests/browser, docs/dashboard.md) drive headless Chromium through
# Selenium: Debian's chromium and chromium-driver (nothing is downloaded by Selenium itself).
chromium-check:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then exit 0; fi; \
	echo "chromium-check: the dashboard's browser tests need chromium and chromedriver; installing chromium chromium-driver (apt-get) ..."; \
	if command -v apt-get >/dev/null 2>&1 && $(SUDO) apt-get update -qq \
	   && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium chromium-driver >/dev/null; then \
	  echo "chromium-check: installed $$(chromium --version 2>/dev/null | head -n 1)"; \
	else \
	  echo "chromium-check: ERROR: could not install Chromium. Install chromium and chromium-driver (e.g. apt-get install" \
	       "chromium chromium-driver) so that chromium and chromedriver are on PATH; then run make again." >&2; \
	  exit 1; \
	fi

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info $(PLUGINS:%=%/*.egg-info)
