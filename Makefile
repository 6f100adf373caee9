# Two entry points: `make demo` (the main job) and `make test` (the whole suite).
# The CPU build of torch is pinned; override with e.g. `make test TORCH_SPEC=torch==2.5.1`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.cfx-installed

.PHONY: demo test bench install clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	echo "$(TORCH_SPEC)" > $(VENV)/torch-constraint.txt
	$(BIN)/python -m pip install --quiet -c $(VENV)/torch-constraint.txt -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m cfx.train

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python -m cfx.bench overhead --quick

clean:
	rm -rf $(VENV) build *.egg-info
