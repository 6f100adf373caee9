# Two entry points: `make demo` (the main job) and `make test` (the whole suite).
# The CPU build of torch is pinned; override with e.g. `make test TORCH_SPEC=torch==2.5.1`.
# Every other package is pinned by constraints.txt (the versions CI last proved); `make lock` refreshes it.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
CONSTRAINTS := constraints.txt
BIN := $(VENV)/bin
STAMP := $(VENV)/.cfx-installed

.PHONY: demo test bench docs docs-serve install lock clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c $(CONSTRAINTS) --upgrade pip
	@echo "installing $(TORCH_SPEC) (the CPU build), then cfx and its test dependencies (about 3 GB in all)"
	$(BIN)/python -m pip install --progress-bar on "$(TORCH_SPEC)"
	echo "$(TORCH_SPEC)" > $(VENV)/torch-constraint.txt
	$(BIN)/python -m pip install --progress-bar on -c $(CONSTRAINTS) -c $(VENV)/torch-constraint.txt -e ".[test]"
	touch $(STAMP)

# GPT-2 tiny on the stdlib's source text, saved; the run ends with the command that talks to the model
demo: $(STAMP)
	mkdir -p runs
	$(BIN)/python -m cfx.train --save runs/demo.safetensors

test: $(STAMP)
	$(BIN)/python -m pytest

# the documentation site (docs/, the notebooks, the API reference from the docstrings) into site/; warnings are errors
docs: $(STAMP)
	$(BIN)/python -m mkdocs build --strict

docs-serve: $(STAMP)
	$(BIN)/python -m mkdocs serve --strict

bench: $(STAMP)
	$(BIN)/python -m cfx.bench overhead --quick

# The newest versions pyproject.toml admits, resolved in a scratch venv and written to constraints.txt;
# run `make test` after it: what it proves is what a fresh clone then installs.
lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install --quiet --upgrade pip
	.venv-lock/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	echo "$(TORCH_SPEC)" > .venv-lock/torch-constraint.txt
	.venv-lock/bin/python -m pip install --quiet -c .venv-lock/torch-constraint.txt -e ".[test]"
	{ echo "# The versions CI last proved (make test on a clean clone). Refresh with 'make lock', then run 'make test'."; \
	  echo "# torch is pinned by the Makefile's TORCH_SPEC, not here."; \
	  .venv-lock/bin/python -m pip freeze --all --exclude-editable | grep -v '^torch=='; } > $(CONSTRAINTS)
	rm -rf .venv-lock
	rm -f $(STAMP)

clean:
	rm -rf $(VENV) .venv-lock build *.egg-info
