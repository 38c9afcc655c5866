# `make setup` creates .venv; `make demo` and `make test` run it first when .venv is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Where pip looks for torch besides its usual places. Unset (the default): PyPI, whose torch==2.13.0
# on Linux x86_64 is the CUDA build (~2.5 GB with its nvidia-* wheels). TORCH_INDEX=cpu: PyTorch's
# CPU wheels (~190 MB); or any index URL. `make setup TORCH_INDEX=cpu`.
TORCH_INDEX ?=
TORCH_INDEX_URL := $(if $(filter cpu,$(TORCH_INDEX)),https://download.pytorch.org/whl/cpu,$(TORCH_INDEX))
TORCH_PIP := $(if $(TORCH_INDEX_URL),--extra-index-url $(TORCH_INDEX_URL))

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# torch is pinned first so that nothing downstream pulls another build of it.
	$(PY) -m pip install -q $(TORCH_PIP) torch==2.13.0
	# the cluster extras ([ray], [dask], [hf]) too, for their tests; with torch again, so none pulls another build
	$(PY) -m pip install -q $(TORCH_PIP) torch==2.13.0 -e ".[dev,ray,dask,hf]"
	# Azurite (Azure Blob emulator, from npm) for tests/test_pack_stores.py; skipped there, said why, without npm
	if command -v npm >/dev/null; then npm install -s --prefix $(VENV)/node --no-audit --no-fund azurite@3.37.0 \
		|| echo "azurite did not install: the Azure lock tests will be skipped"; \
	else echo "npm not found: the Azure lock tests will be skipped"; fi
	touch $(STAMP)

setup: $(STAMP)

# The demo packs the Python stdlib (about 170 MB with its checkpoint) under DEMO_DATA: data/ is git-ignored.
DEMO_DATA ?= data/demo
demo: $(STAMP)
	$(PY) examples/demo.py --data $(DEMO_DATA)/stdlib

# The test files run on 2 processes (pytest-xdist), each file whole on one of them (its module fixtures built
# once), the slowest first (tests/conftest.py's SLOW_FIRST); TEST_PROCS=0 runs them in this one process.
TEST_PROCS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q tests -n $(TEST_PROCS) --dist loadfile --no-loadscope-reorder --durations=25

bench: $(STAMP)
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache demo_data data/demo
