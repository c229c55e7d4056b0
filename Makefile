# Two entry points, each self-installing into .venv:
#   make demo   the main job
#   make test   the test suite (CPU: kernels run under the Triton interpreter)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test clean

$(STAMP): pyproject.toml constraints/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints/cpu.txt -e '.[test,demo,hf]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/flash-dma demo

test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n 2

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
