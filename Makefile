# Both targets set themselves up: a .venv with the project and its test tools, made on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest

demo: $(STAMP)
	$(BIN)/spotdrain simulate

bench: $(STAMP)
	$(BIN)/python -m bench.run

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
