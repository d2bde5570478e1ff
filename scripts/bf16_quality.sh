#!/usr/bin/env bash
# `just bf16-quality`: issue 20's quality bar for the bf16 CPU path against f32 on the SmolLM2 GGUF.
#  1. φ of the first PAIRS HH helpful-base pairs in f32 and bf16 (`onepass features extract`, a
#     scratch cache): per-sequence cosine (scripts/bf16_quality.py; fails below 0.999).
#  2. Greedy decoding of the first PROMPTS prompts for TOKENS tokens in both (bf16_agreement example).
# The third number, passive/mini-hh-ci's held-out accuracy, comes from two runs:
#   just reproduce-passive mini-hh-ci; just reproduce-passive mini-hh-ci --set data.dtype=bf16
#   .venv-bench/bin/python scripts/bf16_quality.py --runs F32_RUN BF16_RUN
set -euo pipefail
cd "$(dirname "$0")/.."
pairs=${1:-200}
prompts=${2:-50}
tokens=${3:-32}
bench=bf16-quality
source scripts/bench_env.sh
"$py" -c "import pyarrow, pandas" 2>/dev/null || "$py" -m pip install --quiet pyarrow pandas
cargo build --release -p runner -p features --example bf16_agreement --quiet
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
data=${ONEPASS_DATA:-../shared/datasets}/hh_rlhf/helpful-base-test.jsonl.gz
for dt in f32 bf16; do
    RAYON_NUM_THREADS=$threads target/release/onepass --quiet features extract --model "$model" --dataset "$data" \
        --limit "$pairs" --dtype $dt --cache "$out/cache" --out "$out/phi-$dt.parquet" >/dev/null
done
"$py" scripts/bf16_quality.py "$out/phi-f32.parquet" "$out/phi-bf16.parquet"
RAYON_NUM_THREADS=$threads target/release/examples/bf16_agreement "$model" datasets/prompts/prompts.jsonl \
    "$prompts" "$tokens" 2>&1 >/dev/null | tail -n 1
