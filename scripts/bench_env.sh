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
# ONEPASS_CPU=avx2 measures the AVX2 path on an AVX-512 machine, both sides capped: onepass's own
# kernels by that variable, candle's f32 matmul by a build without its AVX-512 kernels
# (`--no-default-features`, in target/avx2: `just build-avx2`), and PyTorch by ATen's, MKL's and
# oneDNN's own caps (each left as given when already set). `$cargo_flags` and `$rel` (the
# binaries' folder) are what the bench scripts build and run with.
cargo_flags=(--release)
rel=target/release
if [[ "${ONEPASS_CPU:-}" == avx2 ]]; then
    export CARGO_TARGET_DIR=target/avx2
    cargo_flags=(--release --no-default-features)
    rel=target/avx2/release
    export ATEN_CPU_CAPABILITY=${ATEN_CPU_CAPABILITY:-avx2}
    export MKL_ENABLE_INSTRUCTIONS=${MKL_ENABLE_INSTRUCTIONS:-AVX2}
    export ONEDNN_MAX_CPU_ISA=${ONEDNN_MAX_CPU_ISA:-AVX2}
fi
# Every figure names the CPU it was measured on, and the caps where set.
cargo build "${cargo_flags[@]}" -p runner --quiet
caps="${ATEN_CPU_CAPABILITY:+ ATEN_CPU_CAPABILITY=$ATEN_CPU_CAPABILITY}${MKL_ENABLE_INSTRUCTIONS:+ MKL_ENABLE_INSTRUCTIONS=$MKL_ENABLE_INSTRUCTIONS}${ONEDNN_MAX_CPU_ISA:+ ONEDNN_MAX_CPU_ISA=$ONEDNN_MAX_CPU_ISA}"
echo "$bench: cpu: $($rel/onepass cpu)${caps:+; PyTorch capped:$caps}" >&2
