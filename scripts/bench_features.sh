#!/usr/bin/env bash
# `just bench-features`: candle (onepass) against PyTorch + transformers on the same model file,
# the same token ids (batch × len, written by onepass), the same thread count. Rounds alternate the
# engines so that both see the same machine noise; the table reports medians over rounds.
#
# Environment:
#   ONEPASS_BENCH_MODEL    model file or directory (default: the SmolLM2-135M GGUF of fetch-models)
#   ONEPASS_BENCH_THREADS  threads for both engines (default: nproc)
#   ONEPASS_BENCH_PYTHON   a python with torch, transformers, gguf and accelerate (scripts/bench_env.sh); when unset,
#                          .venv-bench/ is created and filled from PyPI (once; ~3 GB with torch)
#   ONEPASS_BENCH_ROUNDS   rounds (default 3);  ONEPASS_BENCH_TRACE=path: also Chrome traces (path.f32, path.bf16)
set -euo pipefail
cd "$(dirname "$0")/.."
bench=bench-features
source scripts/bench_env.sh "$@"  # builds onepass ($rel/onepass)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
ids="$out/ids.json"
bin=$rel/onepass
# The ids (and a warm page cache) first.
RAYON_NUM_THREADS=$threads $bin features bench --model "$model" --batch "$batch" --len "$len" --reps 1 --warmup 0 --ids-out "$ids" >/dev/null
for r in $(seq 1 "$rounds"); do
    echo "bench-features: round $r/$rounds" >&2
    for dt in $dtypes; do
        RAYON_NUM_THREADS=$threads $bin features bench --model "$model" --batch "$batch" --len "$len" --reps "$reps" \
            --dtype $dt ${ONEPASS_BENCH_TRACE:+--trace "$ONEPASS_BENCH_TRACE.$dt"} >"$out/candle-$dt-$r.json"
    done
    # onepass's f32 with candle's own matmul (the `gemm` crate) instead of the packed kernels:
    # what the packed path gained, in the same run
    ONEPASS_F32_KERNEL=candle RAYON_NUM_THREADS=$threads $bin features bench --model "$model" --batch "$batch" \
        --len "$len" --reps "$reps" --dtype f32 | sed 's/"engine":"candle"/"engine":"candle-gemm"/' >"$out/gemm-f32-$r.json"
    for dt in $torch_dtypes; do
        "$py" scripts/bench_features_torch.py --model "$model" --ids "$ids" --dtype $dt --threads "$threads" \
            --reps "$reps" 2>/dev/null >"$out/torch-$dt-$r.json"
    done
done
python3 scripts/bench_features_report.py --pass features --model "$model" "$out"/candle-*.json "$out"/gemm-*.json "$out"/torch-*.json
