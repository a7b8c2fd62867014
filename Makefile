# The two set-up commands of a fresh machine: `make demo` and `make test`.
# Both create .venv and install pipedsl (editable, with its test extras) on first use;
# `make install` does only that.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-random lint typecheck bench results notebooks clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The demo appends its run to bench/results/demo.jsonl, and the page drawn from the
# results is redrawn (`make results`).
demo: $(STAMP)
	PIPEDSL_RESULTS_DIR=bench/results $(VENV)/bin/pipedsl demo --out out
	$(MAKE) --no-print-directory results

# Two workers: most of the suite's time is single-threaded (XLA's compiles, Python), so a
# 2-core machine runs it in about three quarters of the time. A file's tests stay on one
# worker, so that its module fixtures (a Ray cluster, compiled pipelines) are made once.
# The workers take files in collection order (tests/conftest.py puts the slow ones first),
# not in xdist's order of most tests first, which leaves a file of one long test for last.
TEST_WORKERS ?= 2

test: lint typecheck
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

# The synthesiser's property tests with hypothesis drawing anew each run, ten times as many
# examples as `make test`'s fixed draw (tests/conftest.py's `random` profile): for whoever
# changes pipedsl/synthesize.py. A failure prints the @reproduce_failure line that replays it.
RANDOM_TESTS ?= tests/simulator/test_synthesis.py

test-random: $(STAMP)
	HYPOTHESIS_PROFILE=random $(PY) -m pytest -q $(RANDOM_TESTS)

# The format check reads pyproject's [tool.ruff] settings (line length 120).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy reads packages from folders named as they import; pyproject's package-dir maps
# simulator/ and executor/ into pipedsl, so a tree of links under build/ spells that out.
typecheck: $(STAMP)
	rm -rf build/typecheck && mkdir -p build/typecheck/pipedsl
	for f in pipedsl/*; do ln -s "$(CURDIR)/$$f" build/typecheck/pipedsl/; done
	ln -s "$(CURDIR)/simulator" build/typecheck/pipedsl/simulator
	ln -s "$(CURDIR)/executor" build/typecheck/pipedsl/executor
	cd build/typecheck && $(CURDIR)/$(VENV)/bin/mypy -p pipedsl --cache-dir $(CURDIR)/build/mypy-cache

# Re-execute notebooks/*.ipynb in place, in the kernel set-up their test uses, so that they
# are stored with fresh outputs.
notebooks: $(STAMP)
	PIPEDSL_WRITE_NOTEBOOKS=1 $(PY) -m pytest -q tests/test_notebooks.py

bench: $(STAMP)
	$(PY) bench/bench_parse.py
	$(PY) bench/bench_many_defs.py
	$(PY) bench/bench_simulate.py
	$(PY) bench/bench_executor.py
	$(PY) bench/bench_against_jit.py
	$(PY) bench/bench_dispatch_threads.py
	$(PY) bench/activation_bytes.py
	$(PY) bench/bench_hybrid.py
	$(PY) bench/bench_host_sharing.py
	$(PY) bench/bench_world.py
	$(PY) bench/bench_search.py
	$(PY) bench/bench_search.py --cli
	$(PY) bench/bench_synthesis.py
	$(PY) bench/bench_steady_steps.py
	$(PY) bench/published_heldout.py
	$(MAKE) --no-print-directory results

# bench/RESULTS.md, drawn from the runs in bench/results/ (tests/core/test_results.py checks it).
results: $(STAMP)
	$(PY) -m pipedsl.results bench/results -o bench/RESULTS.md

clean:
	rm -rf $(VENV) out build *.egg-info .pytest_cache .hypothesis
