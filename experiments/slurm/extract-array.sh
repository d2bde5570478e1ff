#!/usr/bin/env bash
# Feature extraction as a SLURM job array: one shard of the global batch plan per task, each into
# its own cache directory, then one merge step. Shards are a deterministic partition of the plan
# (batches i, i+N, i+2N, … of the length-sorted distinct conversations), so the merged cache holds
# exactly what a single process would have computed.
#
#   sbatch --array=0-7 experiments/slurm/extract-array.sh      # 8 shards
#   # after the array: merge, then write the pairs file (all cache hits, no GPU needed)
#   sbatch --dependency=afterok:<array job id> --export=ALL,STEP=merge experiments/slurm/extract-array.sh
#
# Edit the variables below (or pass them with --export). Build once beforehand on a GPU node:
#   cargo build --release -p runner --features cuda
#
#SBATCH --job-name=onepass-features
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=8
#SBATCH --mem=64G
#SBATCH --time=04:00:00
#SBATCH --output=logs/%x-%A_%a.out
set -euo pipefail

MODEL=${MODEL:-hf:meta-llama/Meta-Llama-3-8B-Instruct}
DATASET=${DATASET:-data/ultrafeedback_binarized/train_prefs.parquet}
OUT=${OUT:-features/llama3-8b-ultrafeedback.parquet}
WORK=${WORK:-.cache/slurm-features}
ONEPASS=${ONEPASS:-target/release/onepass}
COMMON=(--model "$MODEL" --dataset "$DATASET" --max-len 1024 --batch 16 --dtype bf16 --device auto)

if [[ "${STEP:-shard}" == shard ]]; then
    : "${SLURM_ARRAY_TASK_ID:?run with sbatch --array=0-(N-1)}"
    N=${SLURM_ARRAY_TASK_COUNT:?}
    "$ONEPASS" features extract "${COMMON[@]}" --shard "$SLURM_ARRAY_TASK_ID/$N" \
        --cache "$WORK/shard-$SLURM_ARRAY_TASK_ID"
else
    "$ONEPASS" features merge --into .cache/features "$WORK"/shard-*
    "$ONEPASS" features extract "${COMMON[@]}" --cache .cache/features --out "$OUT"
fi
