# Everything a fresh machine needs: `make demo` and `make test` create .venv on first use, with the exact versions
# the suite passed with (requirements/constraints.txt). `make upgrade-deps` moves those pins to the newest releases.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch first, pinned: it is served from local disk; a bare range would pull a multi-GB CUDA build.
TORCH := torch==2.13.0
CONSTRAINTS := requirements/constraints.txt
LOWEST := requirements/lowest.txt

.PHONY: install demo test test-demo test-fast test-oldest upgrade-deps bench lint clean

install: $(STAMP)

# pip, setuptools and wheel come from the pins too: setuptools builds the editable install.
$(STAMP): pyproject.toml setup.py $(CONSTRAINTS)
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c $(CONSTRAINTS) pip setuptools wheel
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e '.[dev,trl,wandb,mlflow]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/shardtune train tiny-cpu train.resume=none  # a second `make demo` starts over (a finished run is not trained again unasked)

# Two workers (pytest-xdist), each taking whole files (--dist loadfile: a module's shared trained run is made once).
# 687.4 s for 1,151 tests in a checkout, SLURM included, on this 2-core machine (2026-12-05; 698.4 s
# on a fresh clone the same day, and 1,098-1,117 s as two suites at once for 751 tests: bench/RESULTS.md); the suite read
# 1,058-1,145 s on 2026-11-30: the host's speed moves it by nearly 2x (bench/RESULTS.md stop 53).
# CPU-bound (96-99 % busy through a run, bench/RESULTS.md stop 48). --no-loadscope-reorder: files go out in
# tests/conftest.py's costliest-first order, not by their number of tests (xdist's default, which put the SLURM
# file's waits anywhere).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 -m "not demo" tests

# What a demo recipe's header promises, run as written (tests/demo: minutes each, outside `make test`'s budget).
test-demo: $(STAMP)
	$(BIN)/python -m pytest -q -m demo tests/demo

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

# The lower bounds pyproject.toml promises to library users: every direct dependency at its oldest allowed
# release (requirements/lowest.txt), in a venv of its own, against the fast tests.
test-oldest:
	rm -rf .venv-oldest
	$(PY) -m venv .venv-oldest
	.venv-oldest/bin/pip install -q $(TORCH)
	.venv-oldest/bin/pip install -q -c $(LOWEST) -e '.[dev]'
	.venv-oldest/bin/python -m pytest -q tests/unit

# Re-resolve pyproject's ranges to the newest releases (torch stays pinned), write them as the pins, and run the
# fast tests (which check the new pins against pyproject too); a failure puts the old pins back. Then run
# `make clean test` and commit requirements/constraints.txt.
upgrade-deps:
	rm -rf .venv-upgrade
	$(PY) -m venv .venv-upgrade
	.venv-upgrade/bin/pip install -q --upgrade pip setuptools wheel
	.venv-upgrade/bin/pip install -q $(TORCH)
	.venv-upgrade/bin/pip install -q -e '.[dev,trl,wandb,mlflow]' $(TORCH)  # newest releases the ranges admit; torch held
	cp $(CONSTRAINTS) $(CONSTRAINTS).old
	{ echo "# Exact versions the suite passed with: the Makefile installs with -c $(CONSTRAINTS)."; \
	  echo "# Written by 'make upgrade-deps' on $$(date -u +%F) (Python $$(.venv-upgrade/bin/python -c 'import platform; print(platform.python_version())'), $(TORCH) CPU); do not edit by hand."; \
	  .venv-upgrade/bin/pip freeze --all --exclude-editable | sed 's/^torch==\([0-9.]*\)+.*/torch==\1/'; \
	} > $(CONSTRAINTS)
	.venv-upgrade/bin/python -m pytest -q tests/unit || { mv $(CONSTRAINTS).old $(CONSTRAINTS); exit 1; }
	rm -rf .venv-upgrade $(CONSTRAINTS).old
	@echo "pins rewritten: review 'git diff $(CONSTRAINTS)', run 'make clean test', commit"

bench: $(STAMP)
	$(BIN)/python bench/engine_vs_fsdp2.py

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

clean:
	rm -rf $(VENV) .venv-oldest .venv-upgrade runs build *.egg-info src/*.egg-info
