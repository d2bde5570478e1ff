#!/usr/bin/env bash
# Link stubs for a `--features cuda` build on a machine without CUDA's libraries (a login node,
# CI, this project's CPU machines): candle's cudarc links libcuda, libcublas, libcublasLt,
# libcurand and libnvrtc dynamically, so the linker wants them although nothing runs here. This
# writes one shared library per name with the real SONAME (libcuda.so.1, libcublas.so.13, …) that
# defines every symbol cudarc's rlib references, as empty functions; at run time on the GPU
# machine the loader binds the binary to the driver's and the toolkit's real libraries (by
# SONAME), never to these. Prints the `export LIBRARY_PATH=…` line for the caller to eval.
#
#   eval "$(scripts/cuda_toolchain.sh)"; export CUDA_COMPUTE_CAP=90 CARGO_TARGET_DIR=target/cuda-build
#   cargo build --release -p runner --features cuda || true     # compiles cudarc; the link fails
#   eval "$(scripts/cuda_link_stubs.sh)"
#   cargo build --release -p runner --features cuda             # links
#
# How the H100 checks of the README were built (CUDA 13: libcublas.so.13, libcurand.so.10,
# libnvrtc.so.13; the machine's driver must support CUDA 13). ONEPASS_CUDA_TARGET: the target
# directory holding the cudarc rlib (default target/cuda-build).
set -euo pipefail
cd "$(dirname "$0")/.."
target=${ONEPASS_CUDA_TARGET:-target/cuda-build}
rlib=$(ls "$target"/release/deps/libcudarc-*.rlib 2>/dev/null | head -n 1 || true)
if [[ -z "$rlib" ]]; then
    echo "cuda_link_stubs: no libcudarc-*.rlib under $target/release/deps: build with --features cuda first" >&2
    exit 2
fi
out=$PWD/target/cuda-stubs
mkdir -p "$out"
nm "$rlib" 2>/dev/null | awk '$1 == "U" { print $2 }' | sort -u | grep -E '^(cu|nvrtc|curand|cublas)' \
    | grep -v '^cuda' >"$out/symbols.txt"
# name → SONAME, and which symbols it defines (cublasLt before cublas: a prefix of it)
stub() {
    local soname=$1 pattern=$2 exclude=${3:-}
    local c="$out/${soname%%.so*}.c"
    if [[ -n "$exclude" ]]; then
        grep -E "$pattern" "$out/symbols.txt" | grep -vE "$exclude" || true
    else
        grep -E "$pattern" "$out/symbols.txt" || true
    fi | sed 's/.*/void &(void) {}/' >"$c"
    gcc -shared -fPIC -o "$out/$soname" "$c" -Wl,-soname,"$soname"
    ln -sfn "$soname" "$out/${soname%%.so*}.so"
}
stub libcublasLt.so.13 '^cublasLt'
stub libcublas.so.13 '^cublas' '^cublasLt'
stub libcurand.so.10 '^curand'
stub libnvrtc.so.13 '^nvrtc'
stub libcuda.so.1 '^cu' '^(cublas|curand)'
echo "cuda_link_stubs: $(wc -l <"$out/symbols.txt") symbols in $out" >&2
echo "export LIBRARY_PATH='$out':\"\${LIBRARY_PATH:-}\""
