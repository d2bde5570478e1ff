#!/usr/bin/env bash
# `just bench-online`: one chunk of the online loop (issue 31) in onepass against TRL on the
# same model, prompts, n, lengths and threads. The chunk is online-mini's shape with one rloo
# cell: the policy's n samples of the chunk's prompts (generate.rows / chunks), their φ and learned
# reward, one RLOO update, one held-out evaluation (policy.eval_prompts × n). onepass runs
# online-mini for two chunks (the first warms up and moves the policy, as TRL's first generation
# round does) with a fresh φ cache, and its second chunk's row of policy_timings.parquet is
# timed; TRL's RLOOTrainer (scripts/bench_online_trl.py) takes two generation rounds on that
# chunk's prompts and its second is timed. Rounds alternate the engines; the report prints the
# median split of both and the ratio TRL / onepass per round.
#
# Environment: ONEPASS_BENCH_THREADS, ONEPASS_BENCH_ROUNDS (default 3), ONEPASS_BENCH_PYTHON (a
# python with torch, transformers, gguf, peft and trl; when unset, .venv-bench/ gains trl),
# ONEPASS_BENCH_DTYPES / ONEPASS_BENCH_TORCH_DTYPES (default "f32 bf16": onepass with generation,
# φ and policy.dtype in bf16; TRL with bf16 weights and bf16=True).
set -euo pipefail
cd "$(dirname "$0")/.."
bench=bench-online
source scripts/bench_env.sh
"$py" -c "import trl, pyarrow" 2>/dev/null || "$py" -m pip install --quiet trl pyarrow
hf=${ONEPASS_BENCH_HF_DIR:-.cache/bench/smollm2-135m-instruct}
[[ -e "$hf/model.safetensors" ]] || "$py" scripts/gguf_to_hf.py "$model" "$hf"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
spec=(experiments/deploy/online-mini.toml --set seeds=1 --set 'deploy.policy=["rloo"]'
    --set 'policy.adapter="persistent"' --set policy.eval_every_chunks=1 --set deploy.chunks=2
    --set generate.rows=8 --set 'policy.save_adapter="none"' --set "generate.policy=\"$model\""
    --set "features.model=\"$model\"")
for r in $(seq 1 "$rounds"); do
    echo "bench-online: round $r/$rounds" >&2
    for d in $dtypes; do
        # bf16: generation, φ and the policy's training products (policy.dtype) in bf16
        dir=$($rel/onepass run "${spec[@]}" --set "features.cache=\"$out/phi-$d-$r\"" --threads "$threads" \
            --set "generate.dtype=\"$d\"" --set "features.dtype=\"$d\"" --set "policy.dtype=\"$d\"" \
            --out "$out/runs" 2>/dev/null | tail -n 1)
        "$py" - "$dir" "$threads" "$d" >"$out/onepass-$d-$r.json" <<'PY'
import json, sys
import pyarrow.parquet as pq
t = pq.read_table(f"{sys.argv[1]}/policy_timings.parquet").to_pylist()
row = next(x for x in t if x["chunk"] == 2)
keys = ["generation_s", "phi_s", "estimator_s", "policy_s", "critic_s", "eval_generation_s", "eval_phi_s", "eval_score_s", "eval_s"]
res = {"engine": "onepass", "dtype": sys.argv[3], "threads": int(sys.argv[2]), **{k: row[k] for k in keys}}
res["chunk_s"] = sum(row[k] for k in ["generation_s", "phi_s", "estimator_s", "policy_s", "critic_s", "eval_s"])
print(json.dumps(res))
PY
    done
    for d in $torch_dtypes; do
        "$py" scripts/bench_online_trl.py --hf "$hf" --run "$dir" --prompts datasets/prompts/prompts.jsonl \
            --threads "$threads" --dtype "$d" --out "$out/trl" 2>/dev/null | tail -n 1 >"$out/trl-$d-$r.json"
    done
done
python3 scripts/bench_online_report.py "$out"/onepass-*.json "$out"/trl-*.json
