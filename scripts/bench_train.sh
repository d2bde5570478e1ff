#!/usr/bin/env bash
# `just bench-train`: one LoRA policy-update step (forward, backward, Adam) in onepass (candle)
# against PyTorch + transformers + PEFT on the same model file, token ids and thread count.
# Rounds alternate the engines; the table reports medians over rounds and the ratio.
#
# Environment: ONEPASS_BENCH_MODEL, ONEPASS_BENCH_THREADS, ONEPASS_BENCH_ROUNDS (default 3) and
# ONEPASS_BENCH_PYTHON (a python with torch, transformers, gguf and peft; when unset,
# .venv-bench/ is created or completed from PyPI), as for bench-features; ONEPASS_BENCH_DTYPES
# (default "f32 bf16": onepass's bf16 products, `PolicyModel::use_bf16_products`) and
# ONEPASS_BENCH_TORCH_DTYPES (default the same: PyTorch with bf16 weights, PEFT's adapters f32).
set -euo pipefail
cd "$(dirname "$0")/.."
bench=bench-train
source scripts/bench_env.sh "$@"
cargo build "${cargo_flags[@]}" -p policy --example train_step --quiet
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
bin=$rel/examples/train_step
for r in $(seq 1 "$rounds"); do
    echo "bench-train: round $r/$rounds" >&2
    for d in $dtypes; do
        RAYON_NUM_THREADS=$threads $bin "$model" "$batch" "$len" "$reps" "$out/ids.json" "$d" 2>/dev/null | tail -n 1 >"$out/candle-$d-$r.json"
    done
    for d in $torch_dtypes; do
        "$py" scripts/bench_train_torch.py --model "$model" --ids "$out/ids.json" --threads "$threads" \
            --reps "$reps" --dtype "$d" 2>/dev/null >"$out/torch-$d-$r.json"
    done
done
python3 scripts/bench_features_report.py "$out"/candle-*.json "$out"/torch-*.json
