#!/usr/bin/env bash
# A run's cells as a SLURM job array: task i of N runs the cells k with k mod N = i of the spec
# (`onepass run --cells i/N`) into a slice directory; one merge step assembles the run directory,
# whose tables, θ and adapters are byte for byte those of a run in one process.
#
#   sbatch --array=0-7 experiments/slurm/run-array.sh                 # 8 slices
#   # after the array: merge (reads the slices, writes results/<name>-<time>/)
#   sbatch --dependency=afterok:<array job id> --export=ALL,STEP=merge experiments/slurm/run-array.sh
#
# A slice that stops (time limit, preemption, a full disk) resumes as that slice: resubmit the
# task; it continues its directory (`--cells i/N --resume DIR`, done here when DIR exists).
# Every slice loads the world (data, generation, φ) from the shared caches: on a fresh cache, run
# `onepass features extract` first (experiments/slurm/extract-array.sh) or let one slice fill it.
#
# Edit the variables below (or pass them with --export). Build once beforehand:
#   cargo build --release -p runner            # add --features cuda on GPU nodes
#
#SBATCH --job-name=onepass-run
#SBATCH --cpus-per-task=8
#SBATCH --mem=32G
#SBATCH --time=08:00:00
#SBATCH --output=logs/%x-%A_%a.out
set -euo pipefail

SPEC=${SPEC:-experiments/passive/synthetic.toml}
SETS=${SETS:-}                       # e.g. "--set seeds=20 --set stream.samples=50000"
WORK=${WORK:-results/slices}         # one directory per slice: $WORK/task-<i>
OUT=${OUT:-results}
ONEPASS=${ONEPASS:-target/release/onepass}
read -r -a EXTRA <<< "$SETS"

if [[ "${STEP:-slice}" == slice ]]; then
    : "${SLURM_ARRAY_TASK_ID:?run with sbatch --array=0-(N-1)}"
    N=${SLURM_ARRAY_TASK_COUNT:?}
    I=$SLURM_ARRAY_TASK_ID
    mkdir -p "$WORK/task-$I"
    DIR=$(find "$WORK/task-$I" -mindepth 1 -maxdepth 1 -type d | head -n 1)
    if [[ -n "$DIR" ]]; then
        "$ONEPASS" run "$SPEC" "${EXTRA[@]}" --cells "$I/$N" --resume "$DIR" --threads "$SLURM_CPUS_PER_TASK"
    else
        "$ONEPASS" run "$SPEC" "${EXTRA[@]}" --cells "$I/$N" --out "$WORK/task-$I" --threads "$SLURM_CPUS_PER_TASK"
    fi
else
    "$ONEPASS" merge "$SPEC" "${EXTRA[@]}" "$WORK"/task-*/* --out "$OUT"
fi
