// Built with `c++ $(pkg-config --cflags --libs trainmem)` (install.pkg_config):
// the .pc file's flags find trainmem's headers, LibTorch's and the library.
#include <cstdio>

#include <trainmem/report.h>
#include <trainmem/version.h>

int main() {
  std::printf("trainmem %s with LibTorch %s: %s B\n", trainmem::kVersion, trainmem::kTorchVersion,
              trainmem::with_commas(1189632).c_str());
  return 0;
}
