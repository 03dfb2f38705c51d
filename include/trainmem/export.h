#pragma once
/// \file export.h
/// TRAINMEM_API: what the library exports. Every public header includes it.

// Note [Exported symbols]
// The library is compiled with hidden visibility (CXX_VISIBILITY_PRESET
// hidden and VISIBILITY_INLINES_HIDDEN in CMakeLists.txt): a shared
// libtrainmem.so exports only what is marked TRAINMEM_API, the public API,
// and not the helpers of its sources, its inline functions or the template
// instances it happens to compile (LibTorch's, fmt's, nlohmann_json's).
// Marked are every namespace-scope function the library defines out of line
// and every class with out-of-line members, static members, a vtable or a
// base (`class TRAINMEM_API X`: its members, vtable and typeinfo, so that
// dynamic_cast and catch work across the library's boundary);
// tests/layering/check_exports.py (the layering.exports test) fails on one
// left out.
//   - ELF (GCC, Clang): visibility("default"), in a static build too: the
//     static library's objects are the shared one's (the same compile lines,
//     which ccache serves across the two builds). A user who links the static
//     library into a shared library of their own and wants none of it
//     exported from there links with -Wl,--exclude-libs,libtrainmem.a.
//   - Windows: __declspec(dllexport) while building the library
//     (TRAINMEM_BUILDING, set PRIVATE on the library's own targets on Windows),
//     __declspec(dllimport) for its users; in a static build TRAINMEM_STATIC
//     (which trainmem's CMake target passes on to its users, and trainmem.pc's
//     Cflags carry) makes it empty, as there is nothing to import.
#if defined(TRAINMEM_STATIC)
#define TRAINMEM_API
#elif defined(_WIN32)
#if defined(TRAINMEM_BUILDING)
#define TRAINMEM_API __declspec(dllexport)
#else
#define TRAINMEM_API __declspec(dllimport)
#endif
#elif defined(__GNUC__)
#define TRAINMEM_API __attribute__((visibility("default")))
#else
#define TRAINMEM_API
#endif
