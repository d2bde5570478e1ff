#!/usr/bin/env bash
# `just fuzz [SECONDS] [TARGETS...]`: every cargo-fuzz target for SECONDS each (default 60), from
# seed corpora built here (the presets, a few dataset rows, the features fixtures), then a line
# per target: executions, corpus size, and any crash artifact (fuzz/artifacts/<target>/).
# Needs the nightly toolchain and cargo-fuzz (installed here when missing). Not run in CI.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
shift || true
targets=("$@")
[[ ${#targets[@]} -eq 0 ]] && targets=(spec jsonl parquet gguf safetensors)
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
data=${ONEPASS_DATA:-../shared/datasets}
fx=crates/features/tests/fixtures
seed() { mkdir -p "fuzz/corpus/$1"; }
for t in "${targets[@]}"; do seed "$t"; done
cp experiments/*/*.toml crates/runner/tests/bad_inputs/*/spec.toml fuzz/corpus/spec/ 2>/dev/null || true
for f in crates/runner/tests/bad_inputs/*/hh.jsonl datasets/prompts/prompts.jsonl; do
    cp "$f" "fuzz/corpus/jsonl/$(echo "$f" | tr / _)"
done
if [[ -f "$data/hh_rlhf/helpful-base-test.jsonl.gz" ]]; then
    python3 -c "import gzip,sys; f=gzip.open(sys.argv[1],'rt'); sys.stdout.write(''.join(next(f) for _ in range(3)))" "$data/hh_rlhf/helpful-base-test.jsonl.gz" > fuzz/corpus/jsonl/hh-3rows.jsonl
fi
# parquet seeds: a few UltraFeedback rows and a small features file (pyarrow, when present)
python3 - "$data" fuzz/corpus/parquet <<'PY' || echo "fuzz: no pyarrow: the parquet target starts from an empty corpus"
import sys, glob, pyarrow as pa, pyarrow.parquet as pq
data, out = sys.argv[1], sys.argv[2]
for f in glob.glob(f"{data}/**/*.parquet", recursive=True)[:1]:
    pq.write_table(pq.read_table(f).slice(0, 3), f"{out}/uf-3rows.parquet")
t = pa.table({"phi_chosen": [[0.5, -1.0], [1.0, 2.0]], "phi_rejected": [[0.0, 1.0], [2.0, 0.5]], "label": [1.0, 0.0]})
pq.write_table(t, f"{out}/features.parquet")
PY
cp "$fx/tiny-llama-bpe.gguf" "$fx/tiny-qwen2.gguf" fuzz/corpus/gguf/ 2>/dev/null || true
cp "$fx/tiny-llama/model.safetensors" fuzz/corpus/safetensors/tiny-llama.safetensors 2>/dev/null || true
python3 - <<'PY'
import json, struct
h = json.dumps({"score.weight": {"dtype": "F32", "shape": [1, 8], "data_offsets": [0, 32]}}).encode()
open("fuzz/corpus/safetensors/head.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + struct.pack("<8f", *range(8)))
PY
summary=()
for t in "${targets[@]}"; do
    log=$(mktemp)
    echo "fuzz: $t for ${secs}s" >&2
    set +e
    cargo +nightly fuzz run "$t" "fuzz/corpus/$t" -- -max_total_time="$secs" -rss_limit_mb=4096 \
        -max_len=1048576 -timeout=20 -print_final_stats=1 >"$log" 2>&1
    rc=$?
    set -e
    runs=$(grep -oE 'Done [0-9]+ runs' "$log" | grep -oE "[0-9]+" | tail -n 1 || true)
    crash=$(grep -oE 'Test unit written to [^ ]+' "$log" | sed "s/Test unit written to //" | tail -n 1 || true)
    summary+=("$t: rc $rc, ${runs:-?} executions in ${secs}s, corpus $(ls "fuzz/corpus/$t" | wc -l) inputs${crash:+, CRASH: $crash}")
    if [[ $rc -ne 0 ]]; then grep -E 'panicked|ERROR|SUMMARY|Test unit' "$log" | head -n 8 >&2; fi
done
printf '%s\n' "${summary[@]}"
