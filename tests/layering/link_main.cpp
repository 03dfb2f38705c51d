// Linked with one layer of the library and the layers beneath it, nothing
// else (tests/CMakeLists.txt, Note [The layers as targets]): that it links at
// all is the check.
#include <cstdio>

int main() {
  std::puts("linked alone");
  return 0;
}
