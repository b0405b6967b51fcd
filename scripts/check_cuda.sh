#!/usr/bin/env bash
# Compile-checks the CUDA pack kernel (csrc/pack_cuda.cu) for sm_90 with nvcc, then builds
# and runs its host emulation self-test (block logic on CPU threads; no GPU needed).
# Exits non-zero when either fails; skips with a message when nvcc is absent.
# Usage: scripts/check_cuda.sh   (NVCC=/path/to/nvcc to pick a compiler)
set -euo pipefail

nvcc="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$nvcc" ]]; then
  echo "check_cuda: nvcc not found; skipping the CUDA compile check (install the CUDA toolkit to run it)"
  exit 0
fi

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
src="$root/csrc/pack_cuda.cu"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

"$nvcc" -arch=sm_90 -O3 -std=c++17 -Werror all-warnings -I"$root/csrc" -c "$src" -o "$tmp/pack_cuda.o"
echo "check_cuda: pack_cuda.cu compiles for sm_90 ($("$nvcc" --version | grep -o 'release [0-9.]*'))"

"$nvcc" -std=c++20 -O2 -I"$root/csrc" -DASYNCSYNC_PACK_CUDA_SELFTEST -Xcompiler -fno-strict-aliasing,-pthread \
  "$src" -o "$tmp/pack_cuda_selftest"
"$tmp/pack_cuda_selftest"
