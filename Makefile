# The two commands that matter on a fresh machine:  `make train`  and  `make test`.
# Both create .venv and install what they need (torch 2.13.0 unless a torch is already there;
# choose another with `make install TORCH_SPEC="torch==2.5.1"`).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (0: one process); a whole test file runs on one worker
PYTEST_WORKERS ?= 2

.PHONY: install train test lint bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[recipes,dev]"
	touch $@

install: $(VENV)/.installed
	@# TORCH_SPEC given on the command line installs that torch also into an existing .venv
	@if [ "$(origin TORCH_SPEC)" = "command line" ]; then $(PY) -m pip install -q "$(TORCH_SPEC)"; fi

train: install
	$(PY) -m recipes.pretrain $(ARGS)

test: install lint
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=20 $(PYTEST_ARGS)

# part of `make test` (and so of CI): lint, formatting and the type check, in seconds
lint: install
	$(VENV)/bin/ruff check lightning_zero recipes tests benchmarks scripts
	$(VENV)/bin/ruff format --check lightning_zero recipes tests benchmarks scripts
	$(VENV)/bin/mypy lightning_zero --ignore-missing-imports

bench: install
	$(PY) benchmarks/step_time.py $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun
