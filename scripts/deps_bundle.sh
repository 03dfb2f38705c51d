#!/usr/bin/env bash
# Copies what a build needs beyond LibTorch into .deps/ (git-ignored), for a
# machine that has no Debian dev packages and no package registry (the GPU
# machine: scripts/gpu_check.sh). fmt comes with LibTorch's headers; Google
# Benchmark is optional and not bundled.
#
#   .deps/googletest/      /usr/src/googletest (built from source there)
#   .deps/include/nlohmann nlohmann-json3-dev's headers
#   .deps/include/CLI      libcli11-dev's headers
#   .deps/include/gloo     libgloo-dev's headers (distributed audits; NCCL ranks use Gloo for CPU tensors)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.deps}
need() { [ -e "$1" ] || { echo "deps-bundle: $1 not found (install $2)" >&2; exit 1; }; }
need /usr/src/googletest/CMakeLists.txt libgtest-dev
need /usr/include/nlohmann/json.hpp nlohmann-json3-dev
need /usr/include/CLI/CLI.hpp libcli11-dev
need /usr/include/gloo/config.h libgloo-dev
rm -rf "$dest"
mkdir -p "$dest/include"
cp -r /usr/src/googletest "$dest/googletest"
cp -r /usr/include/nlohmann "$dest/include/nlohmann"
cp -r /usr/include/CLI "$dest/include/CLI"
cp -r /usr/include/gloo "$dest/include/gloo"
echo "deps-bundle: $(du -sh "$dest" | cut -f1) in $dest (googletest $(sed -n 's/.*GOOGLETEST_VERSION \([0-9.]*\).*/\1/p' "$dest/googletest/CMakeLists.txt"), nlohmann_json, CLI11, gloo)"
