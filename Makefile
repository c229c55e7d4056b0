# Two entry points, each self-installing:
#   make demo   the main job (.venv)
#   make test   the test suite (CPU: kernels run under the Triton interpreter) at both ends of the
#               tested version range, as CI runs it:
#     make test-pinned   every test, with the pins of constraints/cpu.txt, in .venv
#     make test-latest   the `latest` slice (tests/conftest.py: the docs, the transformers
#                        integrations, the sm90 compile of every kernel, one case of every test and
#                        of each kernel form) with the newest torch, triton, numpy and transformers
#                        that pip resolves today, in .venv-latest (no constraints; re-resolved each run)
# Installs print what pip fetches and how large it is. The test summary counts skipped tests (on
# the CPU, the GPU-only ones); PYTEST_ADDOPTS=-rfEs lists their reasons.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The README's command: two workers, the multi-process tests kept on one (loadgroup).
PYTEST_ARGS := -q -n 2 --dist loadgroup

.PHONY: demo test test-pinned test-latest clean

$(STAMP): pyproject.toml constraints/cpu.txt
	$(PYTHON) -m venv $(VENV)
	@echo "make: installing the pinned torch (CPU), triton and the test, demo and hf extras into $(VENV) (about 1.9 GB)"
	$(BIN)/python -m pip install -c constraints/cpu.txt -e '.[test,demo,hf]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/flash-dma demo

test: test-pinned test-latest

test-pinned: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

# PyPI's Linux torch is the CUDA build (it runs on the CPU too, but brings some GB of nvidia-*
# wheels): the CPU build of a new torch is only on PyTorch's own index (see README).
LATEST := .venv-latest
LATEST_BIN := $(LATEST)/bin

$(LATEST)/bin/python:
	$(PYTHON) -m venv $(LATEST)

# PIP_CONSTRAINT=/dev/null: a constraints file in pip's own configuration (a machine may cap torch at
# the releases it keeps on disk) would hold this run below what a plain `pip install` resolves.
test-latest: $(LATEST)/bin/python
	@echo "make: installing the newest torch, triton, numpy and transformers into $(LATEST) (about 6 GB the first time; later runs fetch only new releases)"
	PIP_CONSTRAINT=/dev/null $(LATEST_BIN)/python -m pip install --upgrade --upgrade-strategy eager -e '.[test,demo,hf]'
	$(LATEST_BIN)/python -m pip list 2>/dev/null | grep -E -i '^(torch|triton|numpy|transformers) '
	TRITON_INTERPRET=1 $(LATEST_BIN)/python -m pytest $(PYTEST_ARGS) -m latest

clean:
	rm -rf $(VENV) $(LATEST) .pytest_cache .hypothesis
