# LibTorch and fmt, shared by the library and its tests.
#
# LibTorch: the floor is the oldest version the suite was built and run
# against (README, "Supported LibTorch"); it also keeps Debian's libtorch-dev
# 1.13 out. TRAINMEM_TORCH_MIN lowers it for a build at your own risk (the GPU
# machine's 2.11 in scripts/gpu_check.sh), never silently.
# Included from a parent project (add_subdirectory, FetchContent), LibTorch's
# imported targets must be visible there too, or the parent cannot link us.
if(NOT TRAINMEM_TOP_LEVEL AND NOT TARGET torch)
  set(CMAKE_FIND_PACKAGE_TARGETS_GLOBAL ON)
endif()
set(TRAINMEM_TORCH_MIN 2.13 CACHE STRING "Oldest LibTorch accepted (2.13: the oldest built and tested)")
if(TRAINMEM_TORCH_MIN VERSION_LESS 2.13)
  message(WARNING "trainmem: TRAINMEM_TORCH_MIN=${TRAINMEM_TORCH_MIN} accepts a LibTorch older than 2.13, "
    "which the suite has not been run against")
endif()
find_package(Torch ${TRAINMEM_TORCH_MIN} QUIET)
if(NOT Torch_FOUND)
  # Say which LibTorch was found, if any, instead of CMake's generic message.
  find_package(Torch QUIET)
  if(Torch_FOUND)
    message(FATAL_ERROR "trainmem needs LibTorch >= ${TRAINMEM_TORCH_MIN}, but found LibTorch "
      "${Torch_VERSION} at ${Torch_DIR}. Point CMAKE_PREFIX_PATH at a newer one, e.g. "
      "`python -c 'import torch;print(torch.utils.cmake_prefix_path)'` of torch >= ${TRAINMEM_TORCH_MIN}.")
  endif()
  message(FATAL_ERROR "trainmem needs LibTorch >= ${TRAINMEM_TORCH_MIN} and found none. Set "
    "CMAKE_PREFIX_PATH to `python -c 'import torch;print(torch.utils.cmake_prefix_path)'` "
    "(or run scripts/bootstrap.sh, which installs torch into .venv).")
endif()
# Recorded in version.h and trainmemConfig.cmake: a user's build must use the
# same LibTorch major.minor (LibTorch's C++ ABI changes between them).
string(REGEX MATCH "^([0-9]+)\\.([0-9]+)" _trainmem_torch_mm "${Torch_VERSION}")
set(TRAINMEM_TORCH_VERSION ${Torch_VERSION})
set(TRAINMEM_TORCH_VERSION_MAJOR ${CMAKE_MATCH_1})
set(TRAINMEM_TORCH_VERSION_MINOR ${CMAKE_MATCH_2})
if(NOT TARGET trainmem_fmt)
  # fmt: the torch wheel ships fmt 12 headers in its include directory, which
  # sits ahead of /usr/include on the compile line. We use exactly those
  # headers, header-only, so the fmt we compile against is the fmt we run; no
  # second fmt (Debian's libfmt-dev 9) is ever linked. See docs/design.md,
  # Note [One fmt].
  find_path(TRAINMEM_FMT_INCLUDE_DIR fmt/format.h PATHS ${TORCH_INCLUDE_DIRS} NO_DEFAULT_PATH)
  if(NOT TRAINMEM_FMT_INCLUDE_DIR)
    message(FATAL_ERROR "trainmem: fmt/format.h not found in LibTorch's include directories (${TORCH_INCLUDE_DIRS})")
  endif()
  # The headers come with LibTorch's include directories; this target only
  # makes them header-only. It is a build-time helper, never installed: fmt
  # never appears in trainmem's public headers.
  add_library(trainmem_fmt INTERFACE)
  target_compile_definitions(trainmem_fmt INTERFACE FMT_HEADER_ONLY=1)
endif()

# Bundled copies for machines without Debian's dev packages (the GPU machine
# has only a torch venv, nvcc, cmake and ninja): `make deps-bundle` copies
# googletest's sources and the nlohmann_json and CLI11 headers into .deps/,
# which scripts/gpu_check.sh passes as TRAINMEM_DEPS_DIR. Installed packages
# win when present.
set(TRAINMEM_DEPS_DIR "" CACHE PATH "folder from `make deps-bundle` (googletest/, include/)")

# nlohmann_json: the report writers' JSON, header-only, private to the library.
find_package(nlohmann_json 3.10 QUIET)
if(NOT nlohmann_json_FOUND AND NOT TARGET nlohmann_json::nlohmann_json)
  if(NOT EXISTS "${TRAINMEM_DEPS_DIR}/include/nlohmann/json.hpp")
    message(FATAL_ERROR "trainmem: nlohmann_json >= 3.10 not found: install nlohmann-json3-dev, or run "
      "`make deps-bundle` on a machine that has it and pass -DTRAINMEM_DEPS_DIR=<that .deps folder>")
  endif()
  add_library(nlohmann_json::nlohmann_json INTERFACE IMPORTED GLOBAL)
  set_target_properties(nlohmann_json::nlohmann_json PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${TRAINMEM_DEPS_DIR}/include")
endif()
if(TRAINMEM_BUILD_TOOLS AND NOT TARGET CLI11::CLI11)
  find_package(CLI11 2.1 QUIET)
  if(NOT CLI11_FOUND AND EXISTS "${TRAINMEM_DEPS_DIR}/include/CLI/CLI.hpp")
    add_library(CLI11::CLI11 INTERFACE IMPORTED GLOBAL)
    set_target_properties(CLI11::CLI11 PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${TRAINMEM_DEPS_DIR}/include")
  endif()
endif()
if(TRAINMEM_BUILD_TESTS AND NOT TARGET GTest::gtest)
  find_package(GTest 1.10 QUIET)
  if(NOT GTest_FOUND AND EXISTS "${TRAINMEM_DEPS_DIR}/googletest/CMakeLists.txt")
    set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
    set(BUILD_GMOCK OFF CACHE BOOL "" FORCE)
    add_subdirectory(${TRAINMEM_DEPS_DIR}/googletest ${PROJECT_BINARY_DIR}/_deps/googletest EXCLUDE_FROM_ALL)
    add_library(GTest::gtest ALIAS gtest)
    add_library(GTest::gtest_main ALIAS gtest_main)
  endif()
endif()
