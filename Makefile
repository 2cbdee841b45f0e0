# One task runner for the README and CI. Everything runs in ./.venv.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of PyTorch; on a GPU machine: make install TORCH=torch (keeps a CUDA build
# already installed in .venv).
TORCH  ?= torch==2.13.0

.PHONY: install demo flower-demo test bench clean FORCE

$(PY):
	@echo "==> creating $(VENV)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch is pinned first, so the package's own range (torch>=2.2) installs nothing more.
# pip's own lines show progress, the C++ core's build among them.
# `make install` always installs; demo and flower-demo install only when $(STAMP) is older
# than what the install builds from (or the C++ core is missing), and skip it otherwise.
STAMP  := $(VENV)/.fusekit-installed
BUILT_FROM := pyproject.toml setup.py fusekit/_version.py $(wildcard csrc/*)

define install-steps
	@echo "==> installing $(TORCH) and fusekit with its C++ core into $(VENV)"
	$(PY) -m pip install --progress-bar on "$(TORCH)" -e ".[test,bench,serve,flower,hf,docs]"
	@touch $(STAMP)
	@echo "==> installed: $$($(PY) -m fusekit --version | tr '\n' ' ')"
endef

install: $(PY)
	$(install-steps)

$(STAMP): $(PY) $(BUILT_FROM) $(if $(wildcard fusekit/_core*.so),,FORCE)
	$(install-steps)

FORCE:

demo: $(STAMP)
	$(PY) -m fusekit demo

# A Flower federation on this machine: a SuperLink and three SuperNodes on 127.0.0.1, one
# round of examples/flower per method, three of PFNM and a BatchNorm MLP fused with and
# without calibration, each run's progress shown as it goes; every process it starts is
# stopped at the end.
flower-demo: $(STAMP)
	$(PY) examples/flower/demo.py

# Five pytest-xdist workers: one for each of the Flower federations (two), which mostly wait
# on Flower's polls and heartbeats, and three kept busy with the rest (tests/conftest.py
# orders them); tests that share a server run on the worker that holds it. Each worker
# costs about 7 s of CPU to start and collect the suite, so more workers than keep two cores
# busy only spend CPU. Python caches what it compiles (__pycache__, ignored by git) even
# where PYTHONDONTWRITEBYTECODE is set: the suite starts hundreds of Python processes (test
# servers with their checker and fork-server processes, commands, Flower's apps), and each
# would otherwise compile fusekit afresh (a server's start 1.8 s of CPU instead of 1.4).
test:
	@echo "==> running the tests on 5 workers: some start fusion servers and Flower federations (a SuperLink and SuperNodes) on 127.0.0.1, and stop them"
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n 5 --dist loadgroup --no-loadscope-reorder

bench:
	$(PY) benchmarks/bench_matching.py
	$(PY) benchmarks/bench_fusion.py
	$(PY) benchmarks/bench_ot_ams.py
	$(PY) benchmarks/bench_quality.py
	$(PY) benchmarks/bench_quality.py --frontier --data digits
	$(PY) benchmarks/bench_quality.py --frontier --data synthetic
	$(PY) benchmarks/bench_rounds.py
	$(PY) benchmarks/bench_resnet.py
	$(PY) benchmarks/bench_transformers.py
	$(PY) benchmarks/bench_service.py
	$(PY) benchmarks/bench_cli.py

clean:
	rm -rf $(VENV) build *.egg-info fusekit/_core*.so
