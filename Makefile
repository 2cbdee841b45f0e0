# One task runner for the README and CI. Everything runs in ./.venv.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: install demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch is pinned to the CPU build first; the package's own range then installs nothing
# more. On a GPU machine install a CUDA build of torch into .venv before `make install`.
install: $(PY)
	$(PY) -m pip install --quiet "torch==2.13.0" -e ".[test,bench]"

demo: install
	$(PY) -m fusekit demo

test:
	$(PY) -m pytest

bench:
	$(PY) benchmarks/bench_matching.py
	$(PY) benchmarks/bench_fusion.py
	$(PY) benchmarks/bench_quality.py

clean:
	rm -rf $(VENV) build *.egg-info fusekit/_core*.so
