#!/usr/bin/env bash
# `just bench-train`: one LoRA policy-update step (forward, backward, Adam) in onepass (candle)
# against PyTorch + transformers + PEFT on the same model file, token ids and thread count.
# Rounds alternate the engines; the table reports medians over rounds and the ratio.
#
# Environment: ONEPASS_BENCH_MODEL, ONEPASS_BENCH_THREADS, ONEPASS_BENCH_ROUNDS (default 3) and
# ONEPASS_BENCH_PYTHON (a python with torch, transformers, gguf and peft; when unset,
# .venv-bench/ is created or completed from PyPI), as for bench-features.
set -euo pipefail
cd "$(dirname "$0")/.."
batch=${1:-8}
len=${2:-256}
reps=${3:-3}
model=${ONEPASS_BENCH_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
threads=${ONEPASS_BENCH_THREADS:-$(nproc)}
rounds=${ONEPASS_BENCH_ROUNDS:-3}
py=${ONEPASS_BENCH_PYTHON:-}
if [[ -z "$py" ]]; then
    if [[ ! -x .venv-bench/bin/python ]]; then
        echo "bench-train: creating .venv-bench (torch, transformers, gguf, peft from PyPI)" >&2
        python3 -m venv .venv-bench
    fi
    .venv-bench/bin/python -c "import torch, transformers, gguf, peft" 2>/dev/null ||
        .venv-bench/bin/pip install --quiet torch transformers gguf accelerate peft numpy
    py=.venv-bench/bin/python
fi
[[ -e "$model" ]] || { echo "bench-train: $model not found (run just fetch-models)" >&2; exit 2; }
cargo build --release -p policy --example train_step --quiet
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
bin=target/release/examples/train_step
for r in $(seq 1 "$rounds"); do
    echo "bench-train: round $r/$rounds" >&2
    RAYON_NUM_THREADS=$threads $bin "$model" "$batch" "$len" "$reps" "$out/ids.json" 2>/dev/null | tail -n 1 >"$out/candle-f32-$r.json"
    "$py" scripts/bench_train_torch.py --model "$model" --ids "$out/ids.json" --threads "$threads" \
        --reps "$reps" 2>/dev/null >"$out/torch-f32-$r.json"
done
python3 scripts/bench_features_report.py "$out"/candle-*.json "$out"/torch-*.json
