#!/usr/bin/env bash
# make gpu-check: everything trainmem does on CUDA, unattended, on a GPU
# machine that has only a torch venv, nvcc, cmake and ninja (no Debian dev
# packages, no package registry). Prints one summary at the end; exit 0 when
# every stage passed.
#
#   1. build the library, the command and the tests from source against the
#      venv's LibTorch (CUDA), with the headers bundled in .deps/
#      (`make deps-bundle` beforehand, on a machine with the dev packages)
#   2. the CUDA tests (gtest *Cuda*), which must run, not skip
#   3. `trainmem audit --device cuda --snapshot` and PyTorch's memory_viz on it;
#      NCCL ranks: `audit --nproc 2 --device cuda` with 2+ GPUs (1 GPU: the
#      1-rank NCCL run of the CUDA tests, the 2-rank run skipped, said)
#   4. timings: audited steps on cuda, and the same on cpu
#   5. EXTRA_PROGRAMS below: further programs (a predicted-vs-measured run)
#   6. with GPU_CHECK_FULL=1: the whole ctest suite in this build
#
# Settings (environment): TORCH_VENV (default /opt/torch/.venv), GPU_BUILD
# (default build-gpu), DEPS (default .deps), JOBS (default nproc), OUT (where
# the log, report and snapshot are copied; default $GPU_BUILD/gpu-check).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
TORCH_VENV=${TORCH_VENV:-/opt/torch/.venv}
GPU_BUILD=${GPU_BUILD:-build-gpu}
DEPS=${DEPS:-.deps}
JOBS=${JOBS:-$(nproc)}
OUT=${OUT:-$GPU_BUILD/gpu-check}
mkdir -p "$GPU_BUILD" "$OUT"
log=$OUT/gpu_check.log
: > "$log"
py=$TORCH_VENV/bin/python
cli=$GPU_BUILD/tools/trainmem/trainmem

# ---- EXTRA_PROGRAMS: the place to add further checks ------------------------
# One entry per program: a shell command run from the repository root after
# the build, with $GPU_BUILD and $OUT set. Each counts as a stage in the
# summary (pass = exit 0); its output goes to the log and to the screen.
# Build their targets by adding them to EXTRA_TARGETS.
EXTRA_TARGETS=(explain_cuda_peaks)
EXTRA_PROGRAMS=(
  # examples/explain_cuda_peaks's two experiments and the capstone per checkpointing variant:
  # predicted max_memory_allocated/reserved beside the measured.
  "$GPU_BUILD/examples/explain_cuda_peaks --gpu"
)
# ------------------------------------------------------------------------------

results=()
failed=0
t_start=$(date +%s)
stage() {  # stage NAME SHELL-LINE | stage NAME PROGRAM ARGS...: runs it, logs it, records PASS/FAIL and seconds
  local name=$1
  shift
  local t0 t1 rc
  t0=$(date +%s)
  echo "==== $name: $*" | tee -a "$log"
  if [ $# = 1 ]; then
    bash -c "$1" 2>&1 | tee -a "$log"
  else
    "$@" 2>&1 | tee -a "$log"
  fi
  rc=${PIPESTATUS[0]}
  t1=$(date +%s)
  if [ "$rc" = 0 ]; then
    results+=("PASS  $(printf '%4d' $((t1 - t0))) s  $name")
  else
    results+=("FAIL  $(printf '%4d' $((t1 - t0))) s  $name (exit $rc)")
    failed=1
  fi
  return "$rc"
}
summary() {
  {
    echo
    echo "==== gpu-check summary ($(( $(date +%s) - t_start )) s in all; log: $log)"
    printf '%s\n' "${results[@]}"
    [ "$failed" = 0 ] && echo "gpu-check: all stages passed" || echo "gpu-check: FAILED"
  } | tee -a "$log"
  exit "$failed"
}

# ---- 0. the machine ------------------------------------------------------------
stage "machine" "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; \
  command -v nvcc && nvcc --version | tail -2; cmake --version | head -1; \
  $py -c 'import torch,sys; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available(), \"python\", sys.version.split()[0])'" \
  || summary
torch_prefix=$($py -c 'import torch; print(torch.utils.cmake_prefix_path)')
nvcc_path=$(command -v nvcc || true)
cuda_home=${CUDA_HOME:-$( [ -n "$nvcc_path" ] && dirname "$(dirname "$(readlink -f "$nvcc_path")")" )}
nvrtc=$(ls "$TORCH_VENV"/lib/python3*/site-packages/nvidia/cu*/lib/libnvrtc.so.* 2>/dev/null | head -1)

# ---- 1. build --------------------------------------------------------------------
[ -d "$DEPS" ] || echo "gpu-check: no $DEPS folder (run make deps-bundle first); relying on installed packages" | tee -a "$log"
stage "configure" cmake -S . -B "$GPU_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  "-DCMAKE_PREFIX_PATH=$torch_prefix" "-DTRAINMEM_DEPS_DIR=$root/$DEPS" -DTRAINMEM_TORCH_MIN=2.11 \
  -DTRAINMEM_BUILD_BENCH=OFF -DTRAINMEM_BUILD_EXAMPLES=ON \
  ${cuda_home:+"-DCUDA_TOOLKIT_ROOT_DIR=$cuda_home" "-DCMAKE_CUDA_COMPILER=$cuda_home/bin/nvcc"} \
  ${nvrtc:+"-DCUDA_nvrtc_LIBRARY=$nvrtc"} || summary
stage "CUDA LibTorch" "grep -q TRAINMEM_WITH_CUDA $GPU_BUILD/build.ninja" || summary
stage "build" cmake --build "$GPU_BUILD" -j "$JOBS" --target trainmem trainmem_cli trainmem_tests capstone \
  "${EXTRA_TARGETS[@]}" || summary

# ---- 2. CUDA tests: each in its own process, as ctest runs them ------------------
stage "CUDA tests" "cd $GPU_BUILD && ctest -R 'Cuda' --output-on-failure --no-tests=error -j 1 > cuda_tests.txt 2>&1; \
  rc=\$?; cat cuda_tests.txt; if grep -q 'Skipped' cuda_tests.txt; then echo 'a CUDA test skipped on a GPU machine'; exit 1; fi; exit \$rc"

# ---- 3. the audit on cuda, with LibTorch's snapshot ---------------------------------
stage "audit --device cuda --snapshot" "$cli audit --device cuda --steps 3 --json --snapshot $OUT/cuda_snapshot.pickle \
  --trace $OUT/cuda_trace.json > $OUT/cuda_report.json && $cli report $OUT/cuda_report.json"
stage "memory_viz reads the snapshot" "$py -m torch.cuda._memory_viz stats $OUT/cuda_snapshot.pickle | tail -5 && \
  $py -c 'import pickle,sys; s=pickle.load(open(sys.argv[1],\"rb\")); t=[e for d in s[\"device_traces\"] for e in d]; \
a=[e for e in t if e[\"action\"]==\"alloc\"]; print(len(s[\"segments\"]), \"segments,\", len(a), \"allocs,\", \
sum(1 for e in a if e.get(\"frames\")), \"with frames\"); sys.exit(0 if a else 1)' $OUT/cuda_snapshot.pickle"

# ---- 3b. NCCL ranks (docs/distributed.md, "What changes on NCCL") --------------
# NCCL takes one device per rank: with 2+ GPUs, `audit --nproc 2 --device cuda`;
# with 1 GPU two ranks are not valid, so the CLI run is skipped, saying so,
# and the NCCL path runs as 1 rank in DistributedCudaTest (stage 2).
stage "NCCL ranks built" "grep -q TRAINMEM_WITH_NCCL $GPU_BUILD/build.ninja || { echo 'no NCCL ranks in this build: \
distributed audits need gloo headers (make deps-bundle copies them into .deps/include/gloo) and torch_cuda with USE_C10D_NCCL'; exit 1; }"
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${ngpu:-0}" -ge 2 ]; then
  stage "audit --nproc 2 --device cuda (NCCL)" "$cli audit --nproc 2 --device cuda --layers 2 --d-model 64 --heads 4 \
    --batch 8 --seq-len 16 --json > $OUT/nccl_ranks.json && $cli report $OUT/nccl_ranks.json 2>/dev/null | head -20; \
    grep -q '\"backend\": \"nccl\"' $OUT/nccl_ranks.json"
else
  echo "==== audit --nproc 2 --device cuda (NCCL): skipped: ${ngpu:-0} GPU(s); NCCL needs one device per rank, \
the 1-rank NCCL run is DistributedCudaTest.NcclRanksMatchSingleProcess (CUDA tests)" | tee -a "$log"
  results+=("SKIP     0 s  audit --nproc 2 --device cuda (NCCL): ${ngpu:-0} GPU, NCCL needs one per rank")
fi

# ---- 4. timings -------------------------------------------------------------------------
timing='import json,sys; d=json.load(open(sys.argv[1])); s=d["steps"]; print(sys.argv[2], "step ms", [round(x["time_ms"],1) for x in s], "peak B", d["peak_bytes"])'
stage "timings cuda" "$cli audit --device cuda --steps 5 --json > $OUT/cuda_steps.json && $py -c '$timing' $OUT/cuda_steps.json cuda"
stage "timings cpu" "$cli audit --device cpu --steps 2 --json > $OUT/cpu_steps.json && $py -c '$timing' $OUT/cpu_steps.json cpu"

# ---- 5. further programs --------------------------------------------------------------
for p in "${EXTRA_PROGRAMS[@]}"; do
  stage "extra: ${p%% *}" "GPU_BUILD=$GPU_BUILD OUT=$OUT $p"
done

# ---- 6. optional: the whole suite ---------------------------------------------------
if [ "${GPU_CHECK_FULL:-0}" = 1 ]; then
  stage "whole suite" "cmake --build $GPU_BUILD -j $JOBS && cd $GPU_BUILD && ctest -E '^install\\.' --output-on-failure -j $JOBS"
fi
summary
