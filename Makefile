# braid: one-command setup, test and benchmark.  `make test`, `make bench`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
NPROC ?= 2
BUILD_DIR ?= build/cmake
NVCC ?= $(shell command -v nvcc 2>/dev/null)
CUDA_CHECK_DIR ?= build/cuda-check

.PHONY: all install deps test test-py test-cpp bench bench-peers sanitize cuda-check clean

all: install

$(VENV)/.deps: Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel
	$(PIP) install "$(TORCH_SPEC)" numpy triton==3.9.0 pytest pytest-benchmark pytest-timeout ninja matplotlib
	touch $@

deps: $(VENV)/.deps

install: deps
	$(PIP) install --no-build-isolation --no-deps -e .

test: install cuda-check test-cpp test-py

# The CUDA sources are torch-free: compiling them for sm_90 needs only nvcc, no GPU.
cuda-check:
	@if [ -n "$(NVCC)" ]; then \
	  mkdir -p $(CUDA_CHECK_DIR) && \
	  for f in $$(find csrc/cuda -name '*.cu' | sort); do \
	    echo "nvcc -arch=sm_90 -c $$f"; \
	    $(NVCC) -std=c++17 -arch=sm_90 -Icsrc -c $$f -o $(CUDA_CHECK_DIR)/$$(basename $$f .cu).o || exit 1; \
	  done; \
	else echo "nvcc not found: CUDA sources not compile-checked"; fi

test-py:
	$(PY) -m pytest tests -q

test-cpp:
	@if command -v cmake >/dev/null 2>&1; then \
	  cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release >/dev/null && \
	  cmake --build $(BUILD_DIR) -j $(NPROC) && \
	  ctest --test-dir $(BUILD_DIR) --output-on-failure; \
	else echo "cmake not found: C++ core tests skipped"; fi

sanitize:
	cmake -S . -B build/asan -DCMAKE_BUILD_TYPE=Debug -DBRAID_SANITIZE=address >/dev/null
	cmake --build build/asan -j $(NPROC)
	ctest --test-dir build/asan --output-on-failure
	cmake -S . -B build/tsan -DCMAKE_BUILD_TYPE=Debug -DBRAID_SANITIZE=thread >/dev/null
	cmake --build build/tsan -j $(NPROC)
	ctest --test-dir build/tsan --output-on-failure

bench: install
	mkdir -p results
	$(PY) -m braid.bench collectives --nproc 2 --json results/collectives.json --plot results/collectives.png
	$(PY) -m braid.bench tp --nproc 2 --json results/tp.json
	$(PY) -m braid.bench sharding --nproc 2 --json results/sharding.json
	$(PY) -m braid.bench ddp --shapes 1x32,2x64,4x128 --json results/ddp.json
	$(PY) -m braid.bench compression --json results/compression.json
	$(PY) -m braid.bench attention --json results/attention.json --plot results/attention.png

bench-peers:
	apt-get update && apt-get install -y openmpi-bin libopenmpi-dev
	$(PIP) install mpi4py deepspeed "$(TORCH_SPEC)"

clean:
	rm -rf build dist *.egg-info results
