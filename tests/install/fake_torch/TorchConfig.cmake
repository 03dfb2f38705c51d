# See TorchConfigVersion.cmake: only find_package(trainmem)'s check is tested.
if(NOT TARGET torch)
  add_library(torch INTERFACE IMPORTED)
endif()
set(TORCH_FOUND TRUE)
