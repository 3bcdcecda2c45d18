# Set-up on a fresh machine: `make demo` or `make test` create .venv on first use.
# torch is installed first and pinned to the CPU build so that pip never pulls CUDA wheels.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo demo-model test test-slow lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dynaseq demo --out runs/demo

# The model `make demo` shows, shipped in the package (about 50 minutes on 2 cores), and the
# table it gives (benchmarks/results/demo_summary.json)
DEMO_MODEL := src/dynaseq/workflows/demo_model
demo-model: $(STAMP)
	OMP_NUM_THREADS=2 $(VENV)/bin/dynaseq demo --train --steps 9000 --out runs/demo_model
	rm -rf $(DEMO_MODEL)
	$(VENV)/bin/dynaseq export runs/demo_model/run --checkpoint latest --out $(DEMO_MODEL)
	$(VENV)/bin/dynaseq demo --out runs/demo
	cp runs/demo/summary.json benchmarks/results/demo_summary.json

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) runs
