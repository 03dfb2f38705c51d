# trainmem: `make demo` and `make test` work on a fresh machine (see README).
# Each installs what is missing (scripts/bootstrap.sh), configures, builds and runs.
BUILD    ?= build
CONFIG   ?= Release
JOBS     ?= $(shell nproc)
ARGS     ?=
CMAKE_ARGS ?=

.PHONY: all configure build demo test bench compare cuda-check clean

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

demo: build
	@$(BUILD)/examples/capstone $(ARGS)

test: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(JOBS)

bench: build
	@test -x $(BUILD)/bench/trainmem_bench || { echo "Google Benchmark not found: bench/ was not built" >&2; exit 1; }
	$(BUILD)/bench/trainmem_bench $(ARGS)

# trainmem beside PyTorch's Python tools on the capstone: bytes, gradients and
# interleaved step times (bench/compare/compare.py; ARGS=--json, --scaling...).
PYTHON ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)
compare: configure
	cmake --build $(BUILD) --target trainmem_compare -j $(JOBS)
	$(PYTHON) bench/compare/compare.py --build $(BUILD) --python $(PYTHON) $(ARGS)

clean:
	rm -rf $(BUILD)
