# Everything a fresh machine needs: `make demo` and `make test` create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch first, pinned: it is served from local disk; a bare range would pull a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: install demo test test-fast bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/shardtune train tiny-cpu

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

bench: $(STAMP)
	$(BIN)/python bench/engine_vs_fsdp2.py

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

clean:
	rm -rf $(VENV) runs build *.egg-info src/*.egg-info
