#!/usr/bin/env bash
# `just bench-rm-step`: one step of a reward model whose features learn (issue 30; LoRA r 8 on
# every linear layer, a linear head on the last token's final-norm state) in onepass (candle)
# against PyTorch + transformers + PEFT on the same model file, token ids and thread count, for
# sgd and for omd (paper Alg. 5, K = 3 HVPs: onepass by central differences of gradients —
# and by forward differences, `omd-forward`, one pass each —, PyTorch by double backward as the
# authors' rm_trainer_hvp.py). `omd-exact` is the same step with exact HVPs by Pearlmutter's
# R-operator on the step's recorded gradient pass (`policy::rop`; the default of a LoRA reward
# model since session 35), the like of PyTorch's exact products. `omd-gn` is onepass's Alg. 5 on the Gauss–Newton matrix (two
# forward passes and one backward per product): another curvature, timed beside PyTorch's
# exact omd for what it costs, not as the same step. Rounds alternate the engines;
# the table reports median seconds per step over rounds and PyTorch's time over onepass's.
#
# Environment: as bench-train (ONEPASS_BENCH_MODEL, _THREADS, _ROUNDS, _PYTHON);
# ONEPASS_BENCH_RULES: onepass's rules to time (default all: sgd omd omd-exact omd-forward omd-gn;
# PyTorch runs sgd and omd, its exact products, for whichever of them are asked for).
set -euo pipefail
cd "$(dirname "$0")/.."
bench=bench-rm-step
source scripts/bench_env.sh "$@"
cargo build "${cargo_flags[@]}" -p policy --example rm_step --quiet
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
bin=$rel/examples/rm_step
for r in $(seq 1 "$rounds"); do
    for rule in ${ONEPASS_BENCH_RULES:-sgd omd omd-exact omd-forward omd-gn}; do
        echo "bench-rm-step: round $r/$rounds, $rule" >&2
        RAYON_NUM_THREADS=$threads $bin "$model" "$rule" "$batch" "$len" "$reps" "$out/ids.json" 2>/dev/null |
            tail -n 1 >"$out/candle-$rule-$r.json"
        # PyTorch's HVPs are exact: omd-forward is onepass's cheaper variant of the same step
        [[ $rule == omd-forward || $rule == omd-gn || $rule == omd-exact ]] && continue
        # PyTorch's double backward can exhaust the machine (killed: the table says so)
        if ! "$py" scripts/bench_rm_step_torch.py --model "$model" --ids "$out/ids.json" --rule "$rule" \
            --threads "$threads" --reps "$reps" 2>"$out/torch-$rule-$r.err" >"$out/torch-$rule-$r.json"; then
            echo "{\"engine\": \"torch\", \"rule\": \"$rule\", \"failed\": \"$(tail -n 1 "$out/torch-$rule-$r.err" | tr -d '"\\' | cut -c1-160)\"}" >"$out/torch-$rule-$r.json"
            echo "bench-rm-step: PyTorch $rule failed (exit $?; killed for memory?)" >&2
        fi
    done
done
python3 scripts/bench_rm_step_report.py --model "$model" "$out"/candle-*.json "$out"/torch-*.json
