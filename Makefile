# The two set-up commands of a fresh machine: `make demo` and `make test`.
# Both create .venv and install pipedsl (editable, with its test extras) on first use.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pipedsl demo --out out

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/bench_parse.py
	$(PY) bench/bench_simulate.py
	$(PY) bench/bench_executor.py
	$(PY) bench/bench_ray.py
	$(PY) bench/bench_search.py

clean:
	rm -rf $(VENV) out build *.egg-info .pytest_cache .hypothesis
