#!/usr/bin/env bash
# Compile every CUDA source under kvboost/csrc/ for sm_80 and sm_90 with nvcc (no GPU needed) and check the ptxas
# resource report: any compile error, register spill or shared-memory overflow fails the check.
# If a python with torch is found, the torch binding (kvboost/csrc/*.cpp) is also syntax-checked against its headers.
#
#   bash kvboost/csrc/compile_check.sh            # from the repository root (or anywhere)
#   NVCC=/path/to/nvcc bash kvboost/csrc/compile_check.sh
#   KVBOOST_ALLOW_SPILLS=1 ...            # report spills as warnings instead of failing
#   KVBOOST_SKIP_BINDING=1 ...            # skip the binding syntax check
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

find_nvcc() {
  if [[ -n "${NVCC:-}" ]]; then echo "$NVCC"; return 0; fi
  if command -v nvcc >/dev/null 2>&1; then command -v nvcc; return 0; fi
  local c
  for c in "${CUDA_HOME:-}/bin/nvcc" "${CUDA_PATH:-}/bin/nvcc" /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc; do
    if [[ -x "$c" ]]; then echo "$c"; return 0; fi
  done
  return 1
}

if ! nvcc_bin="$(find_nvcc)"; then
  echo "compile_check: nvcc not found (looked at \$NVCC, PATH, \$CUDA_HOME/bin, /usr/local/cuda*/bin);" \
       "install the CUDA toolkit to compile kvboost/csrc/" >&2
  exit 1
fi
echo "compile_check: using $nvcc_bin ($("$nvcc_bin" --version | grep -o 'release [0-9.]*' || true))"

# Static shared memory per block must fit the default 48 KiB (dynamic opt-in is not used by these kernels).
smem_limit=$((48 * 1024))
archs=(80 90)
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

shopt -s nullglob
sources=("$here"/*.cu)
if [[ ${#sources[@]} -eq 0 ]]; then
  echo "compile_check: no .cu files under $here" >&2
  exit 1
fi

demangle() { if command -v c++filt >/dev/null 2>&1; then c++filt; else cat; fi; }

# Every (source, arch) compiles at once (nvcc is single-threaded; the architectures are independent), then the
# reports are read in order.
compile_one() {
  local src="$1" arch="$2" name start
  name="$(basename "$src" .cu)"
  start=$(date +%s)
  if "$nvcc_bin" -std=c++17 -O3 --use_fast_math -lineinfo \
      -gencode "arch=compute_$arch,code=sm_$arch" -Xptxas -v \
      -I"$here" -c "$src" -o "$tmp/$name.sm_$arch.o" >"$tmp/$name.sm_$arch.log" 2>&1; then
    echo "$(( $(date +%s) - start ))" >"$tmp/$name.sm_$arch.seconds"
  fi
}
for src in "${sources[@]}"; do
  for arch in "${archs[@]}"; do
    compile_one "$src" "$arch" &
  done
done
wait

status=0
for src in "${sources[@]}"; do
  name="$(basename "$src" .cu)"
  for arch in "${archs[@]}"; do
    log="$tmp/$name.sm_$arch.log"
    if [[ ! -f "$tmp/$name.sm_$arch.seconds" ]]; then
      echo "compile_check: FAILED to compile $src for sm_$arch:" >&2
      cat "$log" >&2
      status=1
      continue
    fi
    echo "compile_check: $name.cu compiled for sm_$arch ($(cat "$tmp/$name.sm_$arch.seconds")s, beside the others)"
    # ptxas report: "Compiling entry function 'X' for 'sm_NN'", then "N bytes stack frame, N bytes spill
    # stores, N bytes spill loads" and "Used N registers, ..., N bytes smem".
    report="$(demangle <"$log" | awk -v limit="$smem_limit" -v allow="${KVBOOST_ALLOW_SPILLS:-0}" '
      /Compiling entry function/ { match($0, /function .*'"'"' for/); fn = substr($0, RSTART + 10, RLENGTH - 15) }
      /spill stores/ {
        st = $0; sub(/ bytes spill stores.*/, "", st); sub(/.*, /, "", st)
        ld = $0; sub(/ bytes spill loads.*/, "", ld); sub(/.*, /, "", ld)
        if (st + 0 > 0 || ld + 0 > 0) {
          printf("%s: %s spills %d bytes stores / %d bytes loads\n", (allow == "1" ? "WARNING" : "ERROR"), fn, st, ld)
          if (allow != "1") bad = 1
        }
      }
      /bytes stack frame/ {
        fr = $0; sub(/ bytes stack frame.*/, "", fr); sub(/^[^0-9]*/, "", fr)
        if (fr + 0 > 0) printf("WARNING: %s uses a %d-byte stack frame (local memory)\n", fn, fr)
      }
      /Used [0-9]+ registers/ {
        regs = $0; sub(/.*Used /, "", regs); sub(/ registers.*/, "", regs)
        smem = 0
        if ($0 ~ /bytes smem/) { smem = $0; sub(/ bytes smem.*/, "", smem); sub(/.*, /, "", smem) }
        printf("  %-70s %3d registers %6d bytes smem\n", fn, regs, smem)
        if (smem + 0 > limit) { printf("ERROR: %s uses %d bytes of static shared memory (> %d)\n", fn, smem, limit); bad = 1 }
      }
      END { exit bad }
    ')" || { echo "$report"; echo "compile_check: resource check FAILED for $src (sm_$arch)" >&2; status=1; continue; }
    echo "$report"
  done
done

# Optional: syntax-check the torch binding against the installed torch headers (a CPU build of torch ships
# them too, minus one generated CUDA config header that is stubbed here).
if [[ "${KVBOOST_SKIP_BINDING:-0}" != "1" ]]; then
  py="${PYTHON:-$(command -v python3 || command -v python || true)}"
  cxx="${CXX:-$(command -v g++ || command -v c++ || true)}"
  if [[ -n "$py" && -n "$cxx" ]] && torch_inc="$("$py" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))' 2>/dev/null)"; then
    py_inc="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
    cuda_inc=""
    for d in "${CUDA_HOME:-}/include" "$(dirname "$(dirname "$(readlink -f "$nvcc_bin")")")/include" \
             /usr/local/cuda/include /usr/local/cuda-*/include; do
      if [[ -f "$d/cuda_runtime_api.h" ]]; then cuda_inc="$d"; break; fi
    done
    mkdir -p "$tmp/stub/c10/cuda/impl"
    if [[ ! -f "$torch_inc/c10/cuda/impl/cuda_cmake_macros.h" ]]; then
      printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >"$tmp/stub/c10/cuda/impl/cuda_cmake_macros.h"
    fi
    syntax_one() {  # torch's headers take most of a minute to parse: the files are checked at once
      "$cxx" -std=c++20 -fsyntax-only -DTORCH_EXTENSION_NAME=kvboost_flash_attn -DTORCH_API_INCLUDE_EXTENSION_H \
          -isystem "$torch_inc" -isystem "$torch_inc/torch/csrc/api/include" -isystem "$tmp/stub" \
          -isystem "$py_inc" -isystem "$cuda_inc" -I"$here" "$1" >"$tmp/$(basename "$1").log" 2>&1 \
        && touch "$tmp/$(basename "$1").ok"
    }
    for cpp in "$here"/*.cpp; do
      syntax_one "$cpp" &
    done
    wait
    for cpp in "$here"/*.cpp; do
      if [[ -f "$tmp/$(basename "$cpp").ok" ]]; then
        echo "compile_check: $(basename "$cpp") syntax ok (torch headers)"
      else
        echo "compile_check: FAILED syntax check of $cpp:" >&2
        cat "$tmp/$(basename "$cpp").log" >&2
        status=1
      fi
    done
  else
    echo "compile_check: skipping the binding syntax check (no python with torch, or no C++ compiler)"
  fi
fi

if [[ $status -ne 0 ]]; then
  echo "compile_check: FAILED" >&2
  exit 1
fi
echo "compile_check: OK (${#sources[@]} CUDA source(s) compiled for ${archs[*]/#/sm_}, resource check passed)"
