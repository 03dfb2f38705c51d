# LibTorch and fmt, shared by the library and its tests.
#
# LibTorch: 2.11 or newer (the floor keeps Debian's libtorch-dev 1.13 out).
# Included from a parent project (add_subdirectory, FetchContent), LibTorch's
# imported targets must be visible there too, or the parent cannot link us.
if(NOT TRAINMEM_TOP_LEVEL AND NOT TARGET torch)
  set(CMAKE_FIND_PACKAGE_TARGETS_GLOBAL ON)
endif()
find_package(Torch 2.11 REQUIRED)
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

# nlohmann_json: the report writers' JSON, header-only, private to the library.
find_package(nlohmann_json 3.10 REQUIRED)
