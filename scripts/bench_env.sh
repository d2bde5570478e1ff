# Sourced by the bench-* scripts (after `cd` to the repository root, with `$bench` naming the
# recipe): the arguments, the model, threads and rounds from ONEPASS_BENCH_*, and `$py`, a python
# with torch, transformers, gguf, accelerate and peft (ONEPASS_BENCH_PYTHON, else .venv-bench/,
# created or completed from PyPI: ~3 GB with torch).
batch=${1:-8}
len=${2:-256}
reps=${3:-3}
model=${ONEPASS_BENCH_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
threads=${ONEPASS_BENCH_THREADS:-$(nproc)}
rounds=${ONEPASS_BENCH_ROUNDS:-3}
# ONEPASS_BENCH_DTYPES="f32": leave bf16 out (bench-features, bench-generate); on a CPU without
# bf16 instructions PyTorch bf16 takes minutes per pass and f32 is the peer that matters, so
# ONEPASS_BENCH_TORCH_DTYPES="f32" keeps onepass's bf16 row and leaves PyTorch's out
dtypes=${ONEPASS_BENCH_DTYPES:-f32 bf16}
torch_dtypes=$(echo "${ONEPASS_BENCH_TORCH_DTYPES:-$dtypes}" | sed 's/f32/float32/; s/bf16/bfloat16/')
py=${ONEPASS_BENCH_PYTHON:-}
if [[ -z "$py" ]]; then
    if [[ ! -x .venv-bench/bin/python ]]; then
        echo "$bench: creating .venv-bench (torch, transformers, gguf, accelerate, peft from PyPI)" >&2
        python3 -m venv .venv-bench
    fi
    .venv-bench/bin/python -c "import torch, transformers, gguf, accelerate, peft" 2>/dev/null ||
        .venv-bench/bin/pip install --quiet torch transformers gguf accelerate peft numpy
    py=.venv-bench/bin/python
fi
[[ -e "$model" ]] || { echo "$bench: $model not found (run just fetch-models)" >&2; exit 2; }
# Every figure names the CPU it was measured on (and the cap, when ONEPASS_CPU=avx2 measures the
# AVX2 path on an AVX-512 machine; candle's f32 gemm dispatches on its own and is not capped, and
# PyTorch is capped with ATEN_CPU_CAPABILITY=avx2).
cargo build --release -p runner --quiet
echo "$bench: cpu: $(target/release/onepass cpu)${ATEN_CPU_CAPABILITY:+; PyTorch capped at $ATEN_CPU_CAPABILITY}" >&2
