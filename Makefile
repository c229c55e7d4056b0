# Two entry points, each self-installing:
#   make demo   the main job (.venv)
#   make test   the test suite (CPU: kernels run under the Triton interpreter) at both ends of the
#               tested version range, as CI runs it:
#     make test-pinned   the pins of constraints/cpu.txt, in .venv
#     make test-latest   the newest torch, triton, numpy and transformers that pip resolves today,
#                        in .venv-latest (no constraints; re-resolved each run)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-pinned test-latest clean

$(STAMP): pyproject.toml constraints/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints/cpu.txt -e '.[test,demo,hf]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/flash-dma demo

test: test-pinned test-latest

test-pinned: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n 2 --dist loadgroup

# PyPI's Linux torch is the CUDA build (it runs on the CPU too, but brings some GB of nvidia-*
# wheels): the CPU build of a new torch is only on PyTorch's own index (see README).
LATEST := .venv-latest
LATEST_BIN := $(LATEST)/bin

$(LATEST)/bin/python:
	$(PYTHON) -m venv $(LATEST)

test-latest: $(LATEST)/bin/python
	$(LATEST_BIN)/python -m pip install -qq --upgrade --upgrade-strategy eager -e '.[test,demo,hf]'
	$(LATEST_BIN)/python -m pip list 2>/dev/null | grep -E -i '^(torch|triton|numpy|transformers) '
	TRITON_INTERPRET=1 $(LATEST_BIN)/python -m pytest -q -n 2 --dist loadgroup

clean:
	rm -rf $(VENV) $(LATEST) .pytest_cache .hypothesis
