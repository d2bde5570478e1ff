#!/usr/bin/env bash
# nvcc for `just check-cuda` only (never for a build that links): candle-kernels' PTX kernels —
# the ones candle launches for onepass's ops — are compiled by the real nvcc, as in a build; the
# sources of its static GGUF MoE/MMQ library (moe_*, mmq_*, mmvq_*: candle's quantized MoE and
# batched quantized matmuls, which onepass does not call) become empty host objects. Compiling
# those takes ~10 minutes of nvcc on 2 cores, and `cargo check` links nothing, so the check
# type-checks the same Rust either way. `just build-cuda` and `just test-cuda` use the real nvcc.
# The real nvcc: ONEPASS_REAL_NVCC, else `nvcc` beside this script's link.
set -euo pipefail
real=${ONEPASS_REAL_NVCC:-$(dirname "$0")/nvcc}
compile=0 out= src=
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
        -c) compile=1 ;;
        -o) out=${args[i + 1]:-} ;;
        *.cu) src=${args[i]} ;;
    esac
done
if [[ $compile = 1 && -n $out && $src =~ (^|/)(moe_[^/]*|mmq_[^/]*|mmvq_[^/]*)\.cu$ ]]; then
    printf '' | cc -x c -c -o "$out" -
    exit 0
fi
exec "$real" "$@"
