#!/usr/bin/env bash
# make fuzz: the libFuzzer targets of tests/fuzz (the snapshot reader and its
# replay; the config.json reader), each for FUZZ_SECONDS (60), from seed
# corpora made here (tiny pickles, one with two devices on expandable
# segments ending in an oom; the stored real recordings; the config
# files). Installs
# Debian's clang when run as root and it is missing. Prints, per target, the
# runs made and whether it found a crash (saved as build-fuzz/crash-*).
#
#   FUZZ_BUILD (build-fuzz), FUZZ_SECONDS (60), BUILD (build: the main build,
#   whose libtrainmem.a and LibTorch prefix are used).
set -uo pipefail
cd "$(dirname "$0")/.."
FUZZ_BUILD=${FUZZ_BUILD:-build-fuzz}
FUZZ_SECONDS=${FUZZ_SECONDS:-60}
BUILD=${BUILD:-build}
PREFIX=$(cat "$BUILD/.prefix" 2>/dev/null) || { echo "fuzz: run make first (no $BUILD/.prefix)" >&2; exit 1; }
[ -f "$BUILD/libtrainmem.a" ] || { echo "fuzz: no $BUILD/libtrainmem.a (run make first)" >&2; exit 1; }
cxx=$(command -v clang++-14 || command -v clang++ || true)
if [ -z "$cxx" ] && [ "$(id -u)" = 0 ]; then
  echo "fuzz: installing clang-14 and libclang-rt-14-dev" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q clang-14 libclang-rt-14-dev >&2
  cxx=$(command -v clang++-14 || true)
fi
[ -n "$cxx" ] || { echo "fuzz: clang++ not found (apt-get install clang-14 libclang-rt-14-dev)" >&2; exit 1; }
cmake -S tests/fuzz -B "$FUZZ_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER="$cxx" \
  "-DCMAKE_PREFIX_PATH=$PREFIX" "-DTRAINMEM_LIBRARY=$PWD/$BUILD/libtrainmem.a" > "$FUZZ_BUILD.configure.log" 2>&1 ||
  { cat "$FUZZ_BUILD.configure.log" >&2; exit 1; }
cmake --build "$FUZZ_BUILD" || exit 1

# Seed corpora: a snapshot pickled by Python (plain data, protocol 4) and
# the project's config files.
python3 - "$FUZZ_BUILD/corpus/snapshot" <<'PY'
import os, pickle, sys
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
seg = {"device": 0, "address": 1 << 20, "total_size": 2 << 20, "allocated_size": 1024, "requested_size": 1000,
       "stream": 0, "segment_type": "small", "is_expandable": False,
       "blocks": [{"address": 1 << 20, "size": 1024, "requested_size": 1000, "state": "active_allocated",
                   "frames": [{"name": "f", "filename": "x.py", "line": 3}]},
                  {"address": (1 << 20) + 1024, "size": (2 << 20) - 1024, "requested_size": 0, "state": "inactive",
                   "frames": []}]}
trace = [{"action": "segment_alloc", "addr": 1 << 20, "size": 2 << 20, "stream": 0, "time_us": 1, "frames": []},
         {"action": "alloc", "addr": 1 << 20, "size": 1000, "stream": 0, "time_us": 2,
          "frames": [{"name": "f", "filename": "x.py", "line": 3}]}]
snap = {"segments": [seg], "device_traces": [trace], "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""}}
for proto in (2, 4, 5):
    with open(os.path.join(out, f"tiny{proto}.pickle"), "wb") as f:
        pickle.dump(snap, f, protocol=proto)
# Two devices, device 1 on expandable segments (segment_map / segment_unmap),
# a block live before recording began, and an oom on device 1.
exp = {"device": 1, "address": 1 << 30, "total_size": 20 << 20, "allocated_size": 4 << 20,
       "requested_size": 4 << 20, "stream": 0, "segment_type": "large", "is_expandable": True,
       "blocks": [{"address": 1 << 30, "size": 4 << 20, "requested_size": 4 << 20, "state": "active_allocated",
                   "frames": []},
                  {"address": (1 << 30) + (4 << 20), "size": 16 << 20, "requested_size": 0, "state": "inactive",
                   "frames": []}]}
trace1 = [{"action": "segment_map", "addr": (1 << 30) + (20 << 20), "size": 2 << 20, "stream": 0, "time_us": 1,
           "frames": []},
          {"action": "alloc", "addr": (1 << 30) + (4 << 20), "size": 8 << 20, "stream": 0, "time_us": 2, "frames": []},
          {"action": "free_requested", "addr": (1 << 30) + (4 << 20), "size": 8 << 20, "stream": 0, "time_us": 3,
           "frames": []},
          {"action": "free_completed", "addr": (1 << 30) + (4 << 20), "size": 8 << 20, "stream": 0, "time_us": 4,
           "frames": []},
          {"action": "segment_unmap", "addr": (1 << 30) + (20 << 20), "size": 2 << 20, "stream": 0, "time_us": 5,
           "frames": []},
          {"action": "oom", "addr": 0, "size": 80 << 30, "stream": 0, "time_us": 6, "device_free": 1 << 20,
           "frames": []}]
multi = {"segments": [seg, exp], "device_traces": [trace, trace1],
         "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
with open(os.path.join(out, "two_devices_expandable.pickle"), "wb") as f:
    pickle.dump(multi, f, protocol=4)
PY
# The stripped real recordings under 100 KiB (tests/data/recordings; the
# larger ones slow each run a hundredfold) and the files fuzzing found
# before, as seeds too.
find tests/data/recordings -name '*.pickle' -size -100k -exec cp {} "$FUZZ_BUILD/corpus/snapshot/" \;
cp tests/data/fuzz/*.pickle "$FUZZ_BUILD/corpus/snapshot/"
mkdir -p "$FUZZ_BUILD/corpus/config"
cp tests/data/*.json "$FUZZ_BUILD/corpus/config/"

status=0
for t in snapshot config; do
  log="$FUZZ_BUILD/fuzz_$t.log"
  ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 \
    "$FUZZ_BUILD/fuzz_$t" -max_total_time="$FUZZ_SECONDS" -rss_limit_mb=4096 -timeout=20 \
    -artifact_prefix="$FUZZ_BUILD/crash-$t-" "$FUZZ_BUILD/corpus/$t" > "$log" 2>&1
  rc=$?
  runs=$(grep -o 'Done [0-9]* runs' "$log" | tail -1)
  if [ $rc -eq 0 ]; then
    echo "fuzz_$t: ${runs:-no summary}, no crash in ${FUZZ_SECONDS} s"
  else
    echo "fuzz_$t: FAILED (exit $rc), see $log"; tail -20 "$log"; status=1
  fi
done
exit $status
