# Two entry points, each self-installing:
#   make demo   the main job (.venv)
#   make test   the test suite (CPU: kernels run under the Triton interpreter) at both ends of the
#               tested version range, as CI runs it: test-pinned and test-latest, the newest
#               releases installing while the pinned run runs:
#     make test-pinned   every test, with the pins of constraints/cpu.txt, in .venv
#     make test-latest   the `latest` slice (tests/conftest.py: the docs, the transformers
#                        integrations, the sm90 compile of each kernel's first variant, one case of every test and
#                        of each kernel form) with the newest torch, triton, numpy and transformers
#                        that pip resolves today, in .venv-latest (no constraints; re-resolved each run)
# `make test` installs the newest releases in the background, beside the pinned install and run (each
# pip install keeps about one core busy), pip's output going to .venv-latest/install.log, whose end
# is printed when the pinned run ends; the other installs print what pip fetches and how large it is.
# The test summary counts skipped tests (on the CPU, the GPU-only ones); PYTEST_ADDOPTS=-rfEs lists
# their reasons.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The README's command: two workers, the multi-process tests kept on one (loadgroup).
PYTEST_ARGS := -q -n 2 --dist loadgroup
PINNED_RUN := TRITON_INTERPRET=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

.PHONY: demo test test-pinned test-latest latest-install latest-slice clean

$(STAMP): pyproject.toml constraints/cpu.txt
	$(PYTHON) -m venv $(VENV)
	@echo "make: installing the pinned torch (CPU), triton and the test, demo and hf extras into $(VENV) (about 1.9 GB)"
	$(BIN)/python -m pip install -c constraints/cpu.txt -e '.[test,demo,hf]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/flash-dma demo

test-pinned: $(STAMP)
	$(PINNED_RUN)

# PyPI's Linux torch is the CUDA build (it runs on the CPU too, but brings some GB of nvidia-*
# wheels): the CPU build of a new torch is only on PyTorch's own index (see README).
LATEST := .venv-latest
LATEST_BIN := $(LATEST)/bin

$(LATEST)/bin/python:
	$(PYTHON) -m venv $(LATEST)

# PIP_CONSTRAINT=/dev/null: a constraints file in pip's own configuration (a machine may cap torch at
# the releases it keeps on disk) would hold this run below what a plain `pip install` resolves.
# --no-compile: pip would byte-compile all 11,000 modules of the install (60 CPU-seconds of its 140);
# the slice's processes, which may write bytecode (LATEST_RUN), compile the few thousand they import, once.
LATEST_INSTALL := PIP_CONSTRAINT=/dev/null $(LATEST_BIN)/python -m pip install --no-compile --upgrade --upgrade-strategy eager -e '.[test,demo,hf]'
LATEST_RUN := env -u PYTHONDONTWRITEBYTECODE TRITON_INTERPRET=1 $(LATEST_BIN)/python -m pytest $(PYTEST_ARGS) -m latest
LATEST_SIZE := about 6 GB the first time; later runs fetch only new releases

test: $(LATEST)/bin/python
	@echo "make: installing the newest torch, triton, numpy and transformers into $(LATEST) in the background ($(LATEST_SIZE)); pip's output: $(LATEST)/install.log"
	@($(LATEST_INSTALL) > $(LATEST)/install.log 2>&1; echo $$? > $(LATEST)/install.status) & \
	$(MAKE) --no-print-directory $(STAMP) && $(PINNED_RUN); pinned=$$?; \
	echo "make: the pinned run is done; waiting for the install into $(LATEST)"; wait; \
	tail -n 2 $(LATEST)/install.log; \
	if [ "$$(cat $(LATEST)/install.status)" != 0 ]; then echo "make: the install into $(LATEST) failed: $(LATEST)/install.log"; exit 1; fi; \
	if [ $$pinned != 0 ]; then exit $$pinned; fi
	@$(MAKE) --no-print-directory latest-slice

test-latest: latest-install latest-slice

latest-install: $(LATEST)/bin/python
	@echo "make: installing the newest torch, triton, numpy and transformers into $(LATEST) ($(LATEST_SIZE))"
	$(LATEST_INSTALL)

latest-slice:
	$(LATEST_BIN)/python -m pip list 2>/dev/null | grep -E -i '^(torch|triton|numpy|transformers) '
	$(LATEST_RUN)

clean:
	rm -rf $(VENV) $(LATEST) .pytest_cache .hypothesis
