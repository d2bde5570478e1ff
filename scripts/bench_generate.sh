#!/usr/bin/env bash
# `just bench-generate`: onepass's sampling loop against transformers' `generate()` (f32 and
# bf16) on the same model file, the same templated prompts (ids written by onepass), the same
# shape (PROMPTS prompts × N samples, BATCH_PROMPTS prompts per call, T = 1, ≤ MAX_NEW new tokens,
# the deploy mini's by default) and threads. Rounds alternate the engines; medians over rounds.
# Environment as for bench-features (scripts/bench_env.sh): ONEPASS_BENCH_MODEL, _THREADS,
# _ROUNDS, _PYTHON. llama.cpp joins through llama-cpp-python when that Python has it;
# ONEPASS_BENCH_LLAMACPP=1 builds it from PyPI first (llama.cpp compiles from source: ~15 min on
# 2 cores). It runs the GGUF as quantized and one sequence at a time (scripts/bench_generate_llamacpp.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bench=bench-generate
prompts_n=${1:-16}
n=${2:-8}
max_new=${3:-64}
batch_prompts=${4:-8}
source scripts/bench_env.sh
if [[ "${ONEPASS_BENCH_LLAMACPP:-}" == 1 ]]; then
    "$py" -c "import llama_cpp" 2>/dev/null || "$py" -m pip install --quiet llama-cpp-python
fi
llamacpp=$("$py" -c "import llama_cpp; print(1)" 2>/dev/null || true)
[[ -n "$llamacpp" ]] || echo "bench-generate: no llama-cpp-python in $py (ONEPASS_BENCH_LLAMACPP=1 builds it): llama.cpp left out" >&2
cargo build "${cargo_flags[@]}" -p features --example generate_bench --quiet
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
bin=$rel/examples/generate_bench
for r in $(seq 1 "$rounds"); do
    echo "bench-generate: round $r/$rounds" >&2
    for dt in $dtypes; do
        RAYON_NUM_THREADS=$threads $bin "$model" datasets/prompts/prompts.jsonl "$prompts_n" "$n" "$max_new" \
            "$batch_prompts" "$out/ids.json" $dt 2>/dev/null | tail -n 1 >"$out/candle-$dt-$r.json"
    done
    # onepass's f32 with candle's own matmul instead of the packed kernels (what they gained)
    ONEPASS_F32_KERNEL=candle RAYON_NUM_THREADS=$threads $bin "$model" datasets/prompts/prompts.jsonl "$prompts_n" "$n" \
        "$max_new" "$batch_prompts" "$out/ids.json" f32 2>/dev/null | tail -n 1 |
        sed 's/"engine": *"candle"/"engine":"candle-gemm"/' >"$out/gemm-f32-$r.json"
    for dt in $torch_dtypes; do
        "$py" scripts/bench_generate_torch.py --model "$model" --ids "$out/ids.json" --dtype $dt \
            --threads "$threads" 2>/dev/null >"$out/torch-$dt-$r.json"
    done
    if [[ -n "$llamacpp" ]]; then
        "$py" scripts/bench_generate_llamacpp.py --model "$model" --ids "$out/ids.json" --threads "$threads" \
            2>/dev/null >"$out/llamacpp-$r.json"
    fi
done
python3 scripts/bench_features_report.py --pass generate --model "$model" --ids "$out/ids.json" "$out"/candle-*.json "$out"/gemm-*.json "$out"/torch-*.json $(ls "$out"/llamacpp-*.json 2>/dev/null)
