# braid: one-command setup, test and benchmark.  `make test`, `make bench`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
NPROC ?= 2
BUILD_DIR ?= build/cmake
NVCC ?= $(shell command -v nvcc 2>/dev/null)
CUDA_CHECK_DIR ?= build/cuda-check
# csrc/flags.txt: the build settings setup.py and CMakeLists.txt read too.
CXX_FLAGS := $(shell grep '^-' csrc/flags.txt)
CUDA_ARCH := $(shell sed -n 's/^cuda_arch=//p' csrc/flags.txt)

.PHONY: all install core-lib deps test test-py test-py-one test-py-ranks test-slow test-all test-cpp test-cpp-build test-cpp-run docs bench bench-peers sanitize cuda-check cuda-binding-check clean conformance

all: install

# torch once per TORCH_SPEC (the stamp is named by a checksum of the spec, so another spec
# installs again and everything after it follows), the tools of requirements-dev.txt when that
# file changes. --no-compile: Python compiles a module's bytecode when it is first imported,
# instead of pip compiling all of torch's at install (about 40 s of a fresh setup).
TORCH_STAMP := $(VENV)/.torch-$(shell printf '%s' '$(TORCH_SPEC)' | cksum | cut -d' ' -f1)
$(TORCH_STAMP):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel
	$(PIP) install --no-compile "$(TORCH_SPEC)"
	rm -f $(VENV)/.torch-*
	touch $@
$(VENV)/.deps: $(TORCH_STAMP) requirements-dev.txt
	$(PIP) install --no-compile -r requirements-dev.txt
	touch $@

deps: $(VENV)/.deps

# The package is installed editable once; the extension is then built in place with a build
# tree that persists (build/ext), so a second `make` compiles only the sources that changed and
# does nothing when none did.
CXX_SOURCES := $(shell find csrc -name '*.cc' -o -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name 'flags.txt')
$(VENV)/.editable: $(VENV)/.deps setup.py
	BRAID_NO_EXTENSION=1 $(PIP) install --no-build-isolation --no-deps -e .
	touch $@
# Where cmake is present the core is built once, by CMakeLists.txt (position-independent), and both
# the extension (BRAID_CORE_LIB) and the C++ tests (test-cpp) link it; without cmake, or where its
# build of the core fails, setup.py compiles the core itself.
$(VENV)/.built: $(VENV)/.editable $(CXX_SOURCES)
	@if command -v cmake >/dev/null 2>&1 && \
	    cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release >/dev/null && \
	    cmake --build $(BUILD_DIR) --target braid_core -j $(NPROC); then \
	  echo "BRAID_CORE_LIB=$(BUILD_DIR)/libbraid_core.a setup.py build_ext"; \
	  BRAID_CORE_LIB=$(BUILD_DIR)/libbraid_core.a $(PY) setup.py -q build_ext --inplace --build-temp build/ext; \
	else \
	  $(PY) setup.py -q build_ext --inplace --build-temp build/ext; \
	fi
	touch $@

# The core's cmake build needs nothing from the venv: it runs beside the venv's setup (pip
# installing torch and the tools), then the extension is built against both.
install:
	@$(MAKE) --no-print-directory -j2 core-lib $(VENV)/.editable
	@$(MAKE) --no-print-directory $(VENV)/.built

core-lib:
	@if command -v cmake >/dev/null 2>&1; then \
	  cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release >/dev/null && \
	  MAKEFLAGS= cmake --build $(BUILD_DIR) --target braid_core -j $(NPROC) || \
	  echo "the core's cmake build failed: setup.py builds the core"; \
	fi

# make test: first the tests that run in one process, with the build of the C++ tests, the CUDA
# sources' checks and the documentation beside them (all CPU-bound: the two cores are shared
# evenly), then the C++ tests, then the tests with ranks alone. Measured: work of any kind beside
# the multi-rank tests slows them by more than it takes alone, as their ranks wait on each other
# for the core it holds. The background's output follows the one-process tests'; any failure
# fails the target.
test: install
	@mkdir -p build
	@( $(MAKE) --no-print-directory cuda-check test-cpp-build docs > build/test-background.log 2>&1; \
	   echo $$? > build/test-background.rc ) & bg=$$!; \
	 $(MAKE) --no-print-directory test-py-one; one=$$?; \
	 wait $$bg; echo "== C++ test build, CUDA checks, docs (run beside the one-process tests):"; \
	 cat build/test-background.log; \
	 if [ "$$(cat build/test-background.rc)" != 0 ]; then echo "make test: the background step failed"; exit 1; fi; \
	 $(MAKE) --no-print-directory test-cpp-run || exit 1; \
	 $(MAKE) --no-print-directory test-py-ranks; ranks=$$?; \
	 [ $$one = 0 ] && exit $$ranks; exit $$one

# The documentation site from docs/ into site/, the API reference from the docstrings
# (mkdocstrings reads the sources: the package is linked under build/docs-src as it is imported,
# braid.comm for comm/, ...); strict: a broken link, anchor or docstring reference fails it.
DOC_PACKAGES := comm kernels optim ft plan bench trace
docs: $(VENV)/.deps
	@mkdir -p build/docs-src/braid
	@for p in $(DOC_PACKAGES); do ln -sfn ../../../$$p build/docs-src/braid/$$p; done
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

# The CUDA sources are torch-free: compiling them for sm_90 needs only nvcc, no GPU. Where cmake
# is present, test-cpp's build compiles them (CMakeLists.txt, target braid_cuda) and this does not
# compile them a second time.
cuda-check:
	@if [ -n "$(NVCC)" ] && ! command -v cmake >/dev/null 2>&1; then \
	  mkdir -p $(CUDA_CHECK_DIR) && \
	  for f in $$(find csrc/cuda -name '*.cu' | sort); do \
	    echo "nvcc -arch=sm_$(CUDA_ARCH) -c $$f"; \
	    $(NVCC) $(filter -std=%,$(CXX_FLAGS)) -arch=sm_$(CUDA_ARCH) -Icsrc -c $$f -o $(CUDA_CHECK_DIR)/$$(basename $$f .cu).o || exit 1; \
	  done; \
	elif [ -z "$(NVCC)" ]; then echo "nvcc not found: CUDA sources not compile-checked"; fi
	@$(MAKE) --no-print-directory cuda-binding-check

# The CUDA half of the torch binding only builds where torch has CUDA; here it is type-checked
# (-fsyntax-only) with BRAID_WITH_CUDA against the installed torch's headers and the CUDA
# toolkit's. The CPU wheel ships c10/cuda's headers but not the one torch's cmake generates
# (cuda_cmake_macros.h, one define); a stand-in for it goes in the check's include folder.
# torch's headers take most of the time: the sources are checked in the two translation units
# setup.py's unity build compiles (torch_binding.cpp alone: its helpers share names with
# backend.cpp's; the rest together), side by side.
CUDA_BINDING_GROUPS := "backend.cpp compression_binding.cpp cuda_comm_binding.cpp cuda_compression_binding.cpp cuda_ipc.cpp cuda_stager.cpp optim_binding.cpp" "torch_binding.cpp"
cuda-binding-check:
	@if [ -n "$(NVCC)" ] && [ -x "$(PY)" ]; then \
	  stub=$(CUDA_CHECK_DIR)/include/c10/cuda/impl && mkdir -p $$stub && \
	  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > $$stub/cuda_cmake_macros.h && \
	  cuda_inc=$$($(NVCC) --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/.*INCLUDES="\(-I[^"]*\)".*/\1/p' | head -1) && \
	  torch_inc=$$($(PY) -c "import sysconfig; from torch.utils.cpp_extension import include_paths; print(' '.join('-isystem ' + p for p in include_paths() + [sysconfig.get_paths()['include']]))") && \
	  pids= && i=0 && \
	  for group in $(CUDA_BINDING_GROUPS); do \
	    i=$$((i + 1)); unit=$(CUDA_CHECK_DIR)/binding_$$i.cpp; : > $$unit; \
	    for f in $$group; do echo "#include \"binding/$$f\"" >> $$unit; done; \
	    echo "c++ -fsyntax-only -DBRAID_WITH_CUDA $$group"; \
	    $(CXX) $(CXX_FLAGS) -fsyntax-only -DBRAID_WITH_CUDA=1 -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H \
	      $$torch_inc -isystem $(CUDA_CHECK_DIR)/include $$cuda_inc -Icsrc $$unit & pids="$$pids $$!"; \
	  done; \
	  for p in $$pids; do wait $$p || exit 1; done; \
	else echo "nvcc or $(PY) not found: the CUDA binding not type-checked"; fi

# test-py leaves out the tests marked slow (multi-second, multi-process: the fault-tolerance,
# simulated-host, soak, benchmark-smoke and conformance tests), which test-slow runs: CI runs
# make test, and make test-all is both (tests/README.md).
# The files whose tests run in one process (no ranks, no subprocesses) go two at a time
# (pytest-xdist); the others one at a time: the ranks of two multi-process tests side by side on
# two cores would miss their deadlines.
ONE_PROCESS_TESTS := tests/test_attention.py tests/test_attention_varlen.py tests/test_device_discipline.py tests/test_optim.py \
  tests/test_plan.py tests/test_reduce_kernel.py tests/test_compression_cuda.py \
  tests/test_compression_kernels.py tests/test_attention_sm90.py tests/test_trace.py
test-py: test-py-one test-py-ranks
test-py-one:
	$(PY) -m pytest $(ONE_PROCESS_TESTS) -q -m "not slow" -n 2
test-py-ranks:
	$(PY) -m pytest tests -q -m "not slow" $(addprefix --ignore=,$(ONE_PROCESS_TESTS))

test-slow: install
	$(PY) -m pytest tests -q -m slow

test-all: test test-slow

# PyTorch's distributed test suite (collective, point-to-point, DDP and object tests) on braid and
# gloo side by side at 2 and 3 ranks; make test-slow runs a share of it (tests/test_conformance.py).
conformance: install
	$(PY) tests/conformance/run.py --world-sizes 2 3

# Opt-in: installs Lightning and accelerate (no dependency of braid) into the venv, every package
# already there held at its version (torch too), and runs tests/test_recipes.py's Lightning and
# accelerate recipes, each on gloo and on braid; versions and the pytest summary go to results/recipes.log.
RECIPES_SPEC ?= lightning==2.6.6 accelerate==1.15.0
.PHONY: recipes-check
recipes-check:
	mkdir -p results
	$(PIP) freeze --exclude-editable > results/recipes-constraints.txt
	$(PIP) install -c results/recipes-constraints.txt $(RECIPES_SPEC)
	$(PY) -c "import accelerate, lightning, torch; print('torch', torch.__version__, 'lightning', \
	  lightning.__version__, 'accelerate', accelerate.__version__)" | tee results/recipes.log
	$(PY) -m pytest tests/test_recipes.py -k "lightning or accelerate" -v -rs -p no:cacheprovider 2>&1 \
	  | tee -a results/recipes.log; exit $${PIPESTATUS[0]}

# Opt-in: installs SLURM (slurmctld, slurmd, munge; Debian packages) and runs braid.ft's SLURM test:
# a one-node cluster started in a temporary folder, each replica an srun step in a retry loop, a
# task killed, the step started again, the replica rejoining bitwise equal. Root only.
.PHONY: slurm-check
slurm-check: install
	mkdir -p results
	command -v slurmctld >/dev/null || (apt-get update -q && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -q slurmctld slurmd slurm-client munge)
	(slurmctld -V; $(PY) -c "import torch; print('torch', torch.__version__)") | tee results/slurm.log
	$(PY) -m pytest tests/test_ft.py -m slow -k slurm -v -rs -p no:cacheprovider 2>&1 \
	  | tee -a results/slurm.log; exit $${PIPESTATUS[0]}

# The suites run side by side (-j): their multi-rank tests spend most of their time waiting.
test-cpp: test-cpp-build test-cpp-run
test-cpp-build:
	@if command -v cmake >/dev/null 2>&1; then \
	  cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release >/dev/null && \
	  cmake --build $(BUILD_DIR) -j $(NPROC); \
	else echo "cmake not found: C++ core tests not built"; fi
test-cpp-run:
	@if command -v cmake >/dev/null 2>&1; then \
	  ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(NPROC); \
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
	$(PY) -m braid.bench multihost --quick --json results/multihost.json --plot results/multihost.png
	$(PY) -m braid.bench pipeline --shapes 256x64x4x256x8x8x32 --microbatches 8 --json results/pipeline.json
	$(PY) -m braid.bench cp --seqs 1024 2048 --json results/cp.json
	$(PY) -m braid.bench moe --json results/moe.json
	$(PY) -m braid.bench recorder --sizes 4K,64M --json results/recorder.json
	$(PY) -m braid.bench optim --json results/optim.json
	$(PY) -m braid.bench delayed --json results/delayed.json
	$(PY) -m braid.bench ft --json results/ft.json
	$(PY) -m braid.bench ft --skip recovery,torchrun --hosts 2 --link-mbit 1000 --json results/ft-2hosts.json
	$(PY) -m braid.bench plan --json results/plan.json

# On a machine with a CUDA GPU whose Python already has torch with CUDA, triton and pytest (no
# venv, no network needed): build braid with its CUDA sources, run the GPU tests and the GPU
# benchmarks. Logs, JSON and plots go to GPU_OUT; each step runs even if the one before failed,
# and the target fails at the end if any did. Three targets, so each fits one limited call.
GPU_PY ?= python3
GPU_OUT ?= results/gpu
GPU_JOBS ?= $(shell nproc)
.PHONY: gpu-build gpu-test gpu-bench
# gpu-build: the whole compiler output goes to the log; the first errors and its end are shown.
gpu-build:
	mkdir -p $(GPU_OUT)
	MAX_JOBS=$(GPU_JOBS) $(GPU_PY) -m pip install --no-build-isolation --no-deps -v -e . > $(GPU_OUT)/build.log 2>&1; \
	  status=$$?; grep -E -A4 "error:|Error " $(GPU_OUT)/build.log | head -60; tail -5 $(GPU_OUT)/build.log; \
	  exit $$status
	$(GPU_PY) -c "import torch; from braid.comm import _C; assert torch.cuda.is_available(), 'no CUDA device'; \
	  assert _C.has_cuda_kernels, 'built without the CUDA kernels'; print(torch.cuda.get_device_name(0))" | tee -a $(GPU_OUT)/build.log
# The communicator's and the compression kernels' tests first (quick); then the attention tests,
# whose time goes to compiling the kernels for each shape class (about 6 s per test on an H200
# machine's CPUs), spread over GPU_TEST_WORKERS processes where pytest-xdist is installed.
GPU_TEST_WORKERS ?= 8
gpu-test:
	mkdir -p $(GPU_OUT)
	status=0; \
	$(GPU_PY) -m pytest tests/test_cuda_ipc.py tests/test_moe.py tests/test_fsdp2_cuda.py tests/test_zero_offload.py \
	  tests/test_ft.py -m gpu -q -rs -p no:cacheprovider 2>&1 \
	  | tee $(GPU_OUT)/test.log; [ $${PIPESTATUS[0]} -eq 0 ] || status=1; \
	$(GPU_PY) -m pytest tests/test_cuda_comm.py tests/test_cuda_backend.py tests/test_group.py tests/test_pg_compression.py \
	  tests/test_compression_cuda.py tests/test_compression_kernels.py tests/test_cp.py::test_ring_attention_on_gpu \
	  tests/test_adaptive.py::test_device_marks_time_the_device_not_the_host \
	  -q -rs -p no:cacheprovider 2>&1 | tee -a $(GPU_OUT)/test.log; [ $${PIPESTATUS[0]} -eq 0 ] || status=1; \
	workers=$$($(GPU_PY) -c "import xdist" 2>/dev/null && echo "-n $(GPU_TEST_WORKERS)"); \
	$(GPU_PY) -m pytest tests/test_attention.py tests/test_attention_varlen.py tests/test_attention_sm90.py $$workers -q -rs -p no:cacheprovider 2>&1 \
	  | tee -a $(GPU_OUT)/test.log; [ $${PIPESTATUS[0]} -eq 0 ] || status=1; \
	exit $$status
gpu-bench:
	mkdir -p $(GPU_OUT)
	status=0; \
	$(GPU_PY) -m braid.bench gpufloor --json $(GPU_OUT)/gpufloor.json 2>&1 | tee $(GPU_OUT)/gpufloor.log; \
	  [ $${PIPESTATUS[0]} -eq 0 ] || status=1; \
	$(GPU_PY) -m braid.bench cuda --json $(GPU_OUT)/cuda.json 2>&1 | tee $(GPU_OUT)/cuda.log; \
	  [ $${PIPESTATUS[0]} -eq 0 ] || status=1; \
	$(GPU_PY) -m braid.bench staging --json $(GPU_OUT)/staging.json 2>&1 | tee $(GPU_OUT)/staging.log; \
	  [ $${PIPESTATUS[0]} -eq 0 ] || status=1; \
	$(GPU_PY) -m braid.bench compression --json $(GPU_OUT)/compression.json 2>&1 | tee $(GPU_OUT)/compression.log; \
	  [ $${PIPESTATUS[0]} -eq 0 ] || status=1; \
	$(GPU_PY) -m braid.bench attention --json $(GPU_OUT)/attention.json --plot $(GPU_OUT)/attention.png 2>&1 \
	  | tee $(GPU_OUT)/attention.log; [ $${PIPESTATUS[0]} -eq 0 ] || status=1; \
	$(GPU_PY) -m braid.bench sharding --nproc 1 --carrier nccl --json $(GPU_OUT)/offload.json \
	  --impls fsdp2-nccl,fsdp2-nccl-offload,fsdp2-nccl-offload-braid-optim,braid-zero3-on-nccl,braid-zero3-offload-on-nccl,braid-zero3-offload-delayed-on-nccl \
	  2>&1 | tee $(GPU_OUT)/offload.log; [ $${PIPESTATUS[0]} -eq 0 ] || status=1; \
	exit $$status

bench-peers:
	apt-get update && apt-get install -y openmpi-bin libopenmpi-dev
	$(PIP) install mpi4py deepspeed "$(TORCH_SPEC)"

clean:
	rm -rf build dist *.egg-info results
