#!/usr/bin/env bash
# A CUDA toolkit from PyPI wheels, enough for candle's build scripts to compile its kernels (nvcc,
# cicc/libdevice, ptxas, the runtime and CCCL headers, libcudart for the link), on a machine
# without a GPU or a system CUDA. Prints `export …` lines for the caller to eval:
#
#   eval "$(scripts/cuda_toolchain.sh)"   # then: cargo check -p runner --features cuda
#
# Why CUDA 13: the cu12 `nvidia-cuda-nvcc-cu12` wheels (12.0–12.9) ship only ptxas and libnvvm,
# not the nvcc driver, cudafe++ or the crt headers; the CUDA 13 wheels (`nvidia-cuda-nvcc`,
# `nvidia-cuda-crt`, `nvidia-nvvm`, …) do, all under one prefix `nvidia/cu13/` whose layout matches
# the nvcc.profile they carry. cudarc (candle's CUDA binding) reads the toolkit version from
# `nvcc --version` and loads libcuda at run time, so nothing here needs a driver.
#
# ONEPASS_CUDA_PREFIX: where the wheels go (default target/cuda-toolchain, git-ignored; reused when
# present). CUDA_COMPUTE_CAP: the architecture the kernels are compiled for (default 80: A100;
# nvidia-smi is what candle would ask otherwise, and there is no GPU here).
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=${ONEPASS_CUDA_PREFIX:-$PWD/target/cuda-toolchain}
version=13.0
pins=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
      nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85)
root="$prefix/nvidia/cu13"
if [[ ! -x "$root/bin/nvcc" || ! -f "$prefix/.complete-$version" ]]; then
    rm -rf "$prefix"
    mkdir -p "$prefix"
    python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$prefix" "${pins[@]}" >&2
    # candle-kernels and cudarc look for lib64/ (the toolkit's usual name); the wheel has lib/.
    [[ -e "$root/lib64" ]] || ln -s lib "$root/lib64"
    # the linker wants an unversioned libcudart.so
    if [[ ! -e "$root/lib/libcudart.so" ]]; then
        so=$(ls "$root"/lib/libcudart.so.* | head -n 1)
        ln -s "$(basename "$so")" "$root/lib/libcudart.so"
    fi
    touch "$prefix/.complete-$version"
fi
"$root/bin/nvcc" --version >&2
echo "export CUDA_HOME='$root' CUDA_PATH='$root' CUDA_ROOT='$root' NVCC='$root/bin/nvcc'"
echo "export PATH='$root/bin':\"\$PATH\""
echo "export LIBRARY_PATH='$root/lib':\"\${LIBRARY_PATH:-}\""
echo "export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-80}"
