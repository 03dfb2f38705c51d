#!/usr/bin/env bash
# make sanitize: the test suite under AddressSanitizer + UndefinedBehaviorSanitizer,
# and the hook, meter, allocator and audit tests under ThreadSanitizer (GCC's
# runtimes). LibTorch itself is not instrumented; scripts/sanitizers/ holds the
# suppressions that needs, each with its reason. Prints how long each part took.
#
#   SAN_BUILD (build-asan), TSAN_BUILD (build-tsan), JOBS (nproc), PREFIX (the
#   LibTorch CMake prefix; default: $BUILD/.prefix from `make configure`),
#   SANITIZE=asan|tsan|all (all).
set -uo pipefail
cd "$(dirname "$0")/.."
SAN_BUILD=${SAN_BUILD:-build-asan}
TSAN_BUILD=${TSAN_BUILD:-build-tsan}
JOBS=${JOBS:-$(nproc)}
BUILD=${BUILD:-build}
PREFIX=${PREFIX:-$(cat "$BUILD/.prefix" 2>/dev/null)}
SANITIZE=${SANITIZE:-all}
supp=$PWD/scripts/sanitizers
[ -n "$PREFIX" ] || { echo "sanitize: no LibTorch prefix (run make configure first)" >&2; exit 1; }
launcher=$(command -v ccache >/dev/null && echo -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
status=0
report=()

# configure_and_build DIR FLAGS TARGETS...
configure_and_build() {
  local dir=$1 flags=$2
  shift 2
  # RelWithDebInfo at -O1: readable stacks, tolerable speed. Unity batches
  # keep LibTorch's headers from being parsed once per source.
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_PREFIX_PATH=$PREFIX" $launcher \
    "-DCMAKE_CXX_FLAGS=$flags -O1 -g -fno-omit-frame-pointer" \
    "-DCMAKE_EXE_LINKER_FLAGS=$flags" "-DCMAKE_SHARED_LINKER_FLAGS=$flags" \
    -DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=8 \
    -DTRAINMEM_BUILD_BENCH=OFF -DTRAINMEM_BUILD_EXAMPLES=ON >/dev/null &&
    cmake --build "$dir" -j "$JOBS" --target "$@"
}

timed() {  # timed LABEL COMMAND...
  local label=$1 t0 rc
  shift
  t0=$(date +%s)
  "$@"
  rc=$?
  report+=("$(printf '%-34s %5d s  %s' "$label" $(( $(date +%s) - t0 )) "$([ $rc = 0 ] && echo ok || echo "FAILED ($rc)")")")
  [ $rc = 0 ] || status=1
  return $rc
}

if [ "$SANITIZE" = all ] || [ "$SANITIZE" = asan ]; then
  # vptr: LibTorch's classes have RTTI from an uninstrumented build, and UBSan's
  # vptr check reports every cast through them (see scripts/sanitizers/README).
  asan_flags="-fsanitize=address,undefined -fno-sanitize=vptr -fno-sanitize-recover=undefined"
  timed "ASan+UBSan build" configure_and_build "$SAN_BUILD" "$asan_flags" trainmem_tests trainmem_cli capstone mnist_audit plan_your_model explain_cuda_peaks
  if [ $status = 0 ]; then
    export ASAN_OPTIONS="detect_leaks=1:detect_container_overflow=0:detect_odr_violation=0:abort_on_error=0:halt_on_error=1:suppressions=$supp/asan.supp"
    export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$supp/ubsan.supp"
    # install.*: they rebuild the library without sanitizers (not what is checked here).
    timed "ASan+UBSan ctest" ctest --test-dir "$SAN_BUILD" -E '^install\.' --output-on-failure -j "$JOBS" --timeout 1500
  fi
fi

if [ "$SANITIZE" = all ] || [ "$SANITIZE" = tsan ]; then
  timed "TSan build" configure_and_build "$TSAN_BUILD" "-fsanitize=thread" trainmem_tests
  if [ -x "$TSAN_BUILD/tests/trainmem_tests" ]; then
    export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:report_signal_unsafe=0:suppressions=$supp/tsan.supp"
    # Hooks, meter, allocator and audit: the code that runs on autograd's and
    # the allocator's threads.
    timed "TSan hook/meter/allocator/audit" "$TSAN_BUILD/tests/trainmem_tests" \
      --gtest_filter='Hooks*:Meter*:Allocator*:Audit*:Offload*:OptimizerInBackward*'
  fi
fi

echo
echo "sanitize summary"
printf '  %s\n' "${report[@]}"
exit $status
