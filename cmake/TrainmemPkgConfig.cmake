# trainmem.pc for builds without CMake. LibTorch ships no .pc file of its own,
# so its include and library directories (those of the LibTorch trainmem was
# built against) are written here; the RUNPATH lets programs start without
# LD_LIBRARY_PATH. Included from the install section of CMakeLists.txt.
get_target_property(_tm_torch_lib torch IMPORTED_LOCATION_RELEASE)
if(NOT _tm_torch_lib)
  get_target_property(_tm_torch_lib torch IMPORTED_LOCATION)
endif()
get_filename_component(_tm_torch_libdir "${_tm_torch_lib}" DIRECTORY)
set(TRAINMEM_PC_TORCH_CFLAGS "")
# A static Windows trainmem's users see TRAINMEM_API empty (Note [Exported symbols]).
if(WIN32 AND NOT BUILD_SHARED_LIBS)
  set(TRAINMEM_PC_TORCH_CFLAGS " -DTRAINMEM_STATIC")
endif()
foreach(dir IN LISTS TORCH_INCLUDE_DIRS)
  string(APPEND TRAINMEM_PC_TORCH_CFLAGS " -I${dir}")
endforeach()
set(TRAINMEM_PC_TORCH_LIBS "-L${_tm_torch_libdir} -Wl,-rpath,${_tm_torch_libdir} -ltorch -ltorch_cpu -lc10")
if(TORCH_CUDA_LIBRARIES)
  string(APPEND TRAINMEM_PC_TORCH_LIBS " -ltorch_cuda -lc10_cuda")
endif()
# The prefix relative to the .pc file, so `cmake --install --prefix` anywhere works.
file(RELATIVE_PATH TRAINMEM_PC_UP /p/${CMAKE_INSTALL_LIBDIR}/pkgconfig /p)
configure_file(${PROJECT_SOURCE_DIR}/cmake/trainmem.pc.in ${PROJECT_BINARY_DIR}/trainmem.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/trainmem.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
unset(_tm_torch_lib)
unset(_tm_torch_libdir)
