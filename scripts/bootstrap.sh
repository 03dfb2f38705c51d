#!/usr/bin/env bash
# Installs what `make demo` / `make test` need and is missing, then prints the
# CMake prefix path of the LibTorch to build against. Idempotent: a second run
# installs nothing and takes well under a second.
#
#   - Debian packages (only when run as root; otherwise it says what is missing)
#   - LibTorch: Torch_DIR or CMAKE_PREFIX_PATH if they already point at one,
#     else torch==2.13.0 from pip into the project-local venv (.venv).
#   - Hugging Face transformers==5.24.0 from pip into that venv (the hf.*
#     ctests compare the config-file models with it, hf_model.h): the release
#     whose modeling code trainmem's GPT-2, LLaMA, Mistral and Qwen follow.
#     TRAINMEM_TRANSFORMERS_VERSION picks another, "none" skips it; offline,
#     it is skipped with a warning and those tests skip.
#   - Hugging Face peft==0.21.2 beside it (the hf.lora_* ctests compare
#     trainmem's LoRA, lora.h, with its LoRA layers); TRAINMEM_PEFT_VERSION
#     picks another, "none" skips it.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "bootstrap: $*" >&2; }

packages=(cmake ninja-build g++ make python3-venv libgtest-dev libgmock-dev
          libbenchmark-dev nlohmann-json3-dev libcli11-dev ccache libgloo-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
# python3-venv is only needed when python3 cannot make a venv by itself.
if [ ${#missing[@]} -gt 0 ] && python3 -m venv --help >/dev/null 2>&1; then
  missing=("${missing[@]/python3-venv}")
  read -ra missing <<<"${missing[*]}"
fi
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    log "installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >&2
    apt-get install -y -q "${missing[@]}" >&2
  else
    log "missing Debian packages (run as root to install): ${missing[*]}"
  fi
fi

# A LibTorch the user already has wins.
if [ -n "${Torch_DIR:-}" ] && [ -f "${Torch_DIR}/TorchConfig.cmake" ]; then
  echo "${Torch_DIR}"
  exit 0
fi
if [ -n "${CMAKE_PREFIX_PATH:-}" ]; then
  IFS=: read -ra prefixes <<<"${CMAKE_PREFIX_PATH}"
  for pre in "${prefixes[@]}"; do
    if [ -f "$pre/Torch/TorchConfig.cmake" ] || [ -f "$pre/share/cmake/Torch/TorchConfig.cmake" ]; then
      echo "${CMAKE_PREFIX_PATH}"
      exit 0
    fi
  done
fi

venv=${TRAINMEM_VENV:-.venv}
want=${TRAINMEM_TORCH_VERSION:-2.13.0}
if [ ! -x "$venv/bin/python" ]; then
  log "creating $venv"
  python3 -m venv "$venv" >&2
fi
# find_spec locates torch without importing it (an import takes seconds).
spec='import importlib.util as u, os; s = u.find_spec("torch"); print(os.path.join(os.path.dirname(s.origin), "share", "cmake") if s else "")'
if [ -z "$("$venv/bin/python" -c "$spec")" ]; then
  log "installing torch==$want into $venv (LibTorch and the Python tools the tests compare with)"
  "$venv/bin/pip" install -q "torch==$want" >&2
fi
# The version from the installed metadata, without importing transformers (seconds).
hf_want=${TRAINMEM_TRANSFORMERS_VERSION:-5.24.0}
hf_have='import importlib.metadata as m
try: print(m.version("transformers"))
except m.PackageNotFoundError: print("")'
if [ "$hf_want" != none ] && [ "$("$venv/bin/python" -c "$hf_have")" != "$hf_want" ]; then
  log "installing transformers==$hf_want into $venv (the hf.* tests compare the config-file models with it)"
  "$venv/bin/pip" install -q "transformers==$hf_want" >&2 ||
    log "could not install transformers==$hf_want: the hf.* comparisons will skip"
fi
peft_want=${TRAINMEM_PEFT_VERSION:-0.21.2}
peft_have='import importlib.metadata as m
try: print(m.version("peft"))
except m.PackageNotFoundError: print("")'
if [ "$hf_want" != none ] && [ "$peft_want" != none ] && [ "$("$venv/bin/python" -c "$peft_have")" != "$peft_want" ]; then
  log "installing peft==$peft_want into $venv (the hf.lora_* tests compare trainmem's LoRA with it)"
  "$venv/bin/pip" install -q "peft==$peft_want" >&2 ||
    log "could not install peft==$peft_want: the LoRA comparisons will skip"
fi
"$venv/bin/python" -c "$spec"
