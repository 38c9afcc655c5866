# `make setup` creates .venv; `make demo` and `make test` run it first when .venv is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# torch is pinned first so that nothing downstream pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# the cluster extras ([ray], [dask], [hf]) too, for their tests; with torch again, so none pulls another build
	$(PY) -m pip install -q torch==2.13.0 -e ".[dev,ray,dask,hf]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q tests --durations=25

bench: $(STAMP)
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache demo_data
