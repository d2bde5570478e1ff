#!/usr/bin/env python3
"""Checks a run's live curves against its tables: reads every cell's event files under
RUN/tb/<cell_id>/ with TensorBoard's own reader (EventAccumulator) and checks that each scalar
equals its column in metrics.parquet, policy.parquet and policy_updates.parquet (as f32, the
precision TensorBoard stores), that every row has its point and no (tag, step) appears twice,
that the stage times are there, and that a run on generated responses logged its sampled
completions per chunk. The tags are listed in docs/src/tensorboard-tags.md.

Usage: check_tensorboard.py RUN_DIR   (pip: tensorboard pyarrow numpy)"""
import pathlib
import sys
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

# tag -> column, per table (crates/runner/src/settings/live.rs writes them)
METRICS = {
    "eval/loss": "eval_loss",
    "eval/accuracy": "eval_accuracy",
    "eval/ties": "eval_ties",
    "reward/train_loss": "train_loss",
    "reward/train_accuracy": "train_accuracy",
    "reward/kappa": "kappa",
    "reward/samples_seen": "samples_seen",
    "theta/err": "theta_err",
    "theta/err_h": "theta_err_h",
    "eval/subopt": "subopt",
    "eval/subopt_avg": "subopt_avg",
    "eval/subopt_pessimistic": "subopt_pessimistic",
    "eval/subopt_pessimistic_ref": "subopt_pessimistic_ref",
    "deploy/regret": "regret",
    "deploy/mean_reward": "mean_reward",
    "deploy/pair_reward": "pair_reward",
    "deploy/cum_pair_reward": "cum_pair_reward",
    "deploy/policy_reward": "policy_reward",
    "deploy/kendall_tau": "kendall_tau",
    "deploy/oracle_ties": "oracle_ties",
}
POLICY = {
    "policy/reward": "policy_reward",
    "policy/sample_reward": "sample_reward",
    "policy/bon_reward": "bon_reward",
    "policy/learned_reward": "learned_reward",
    "policy/kl": "kl",
    "policy/entropy": "entropy",
    "policy/response_tokens": "response_tokens",
    "policy/cut_fraction": "cut_fraction",
    "policy/merge_error": "merge_error",
}
UPDATES = {
    "train/loss": "update_loss",
    "train/grad_norm": "update_grad_norm",
    "train/reward": "update_reward",
    "train/steps": "update_steps",
    "train/kl": "kl",
    "train/entropy": "entropy",
    "train/rollout_oracle_reward": "rollout_oracle_reward",
    "train/rollout_learned_reward": "rollout_learned_reward",
    "train/pairs": "pairs",
    "train/dropped_pairs": "dropped_pairs",
    "train/critic_loss": "critic_loss",
    "train/critic_grad_norm": "critic_grad_norm",
    "train/value_mean": "value_mean",
    "train/return_mean": "return_mean",
}


def f32(x):
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def same(a, b):
    return (np.isnan(a) and np.isnan(b)) or a == b


def rows_of(run, name):
    p = run / name
    if not p.exists():
        return {}
    t = pq.read_table(p).to_pylist()
    by = {}
    for r in t:
        by.setdefault(r["cell_id"], []).append(r)
    return by


def load(cell_dir):
    # every point kept (no reservoir sampling), nothing purged: duplicates stay visible
    ea = EventAccumulator(str(cell_dir), size_guidance={"scalars": 0, "tensors": 0}, purge_orphaned_data=False)
    ea.Reload()
    tags = ea.Tags()
    scalars = {t: [(e.step, e.value) for e in ea.Scalars(t)] for t in tags["scalars"]}
    tensors = {t: [e.step for e in ea.Tensors(t)] for t in tags["tensors"]}
    return scalars, tensors


def check_table(errors, cell, scalars, rows, mapping, step_of, what):
    checked = 0
    for tag, col in mapping.items():
        want = {}
        for r in rows:
            if r.get(col) is not None:
                want[step_of(r)] = f32(r[col])
        got = scalars.get(tag, [])
        if not want:
            if got:
                errors.append(f"{cell}: {tag}: {len(got)} points, but {what} has no {col}")
            continue
        steps = Counter(s for s, _ in got)
        twice = sorted(s for s, n in steps.items() if n > 1)
        if twice:
            errors.append(f"{cell}: {tag}: step(s) {twice[:5]} appear more than once")
        have = dict(got)
        for step, v in sorted(want.items()):
            if step not in have:
                errors.append(f"{cell}: {tag}: no point at step {step} ({what} {col} = {v})")
            elif not same(have[step], v):
                errors.append(f"{cell}: {tag} at step {step}: {have[step]!r} in tb/, {v!r} in {what} ({col})")
            checked += 1
        extra = sorted(set(have) - set(want))
        if extra:
            errors.append(f"{cell}: {tag}: step(s) {extra[:5]} are in no row of {what}")
    return checked


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    run = pathlib.Path(sys.argv[1])
    metrics, policy, updates = (rows_of(run, n) for n in ("metrics.parquet", "policy.parquet", "policy_updates.parquet"))
    if not metrics:
        sys.exit(f"check_tensorboard: {run}/metrics.parquet: missing or empty")
    errors, checked, texts = [], 0, 0
    for cell, rows in sorted(metrics.items()):
        cell_dir = run / "tb" / cell
        if not cell_dir.is_dir():
            errors.append(f"{cell}: no {cell_dir}")
            continue
        scalars, tensors = load(cell_dir)
        chunked = any(r.get("chunk") is not None for r in rows)
        step = (lambda r: r["chunk"]) if chunked else (lambda r: r["step"])
        checked += check_table(errors, cell, scalars, rows, METRICS, step, "metrics.parquet")
        checked += check_table(errors, cell, scalars, policy.get(cell, []), POLICY, lambda r: r["chunk"], "policy.parquet")
        checked += check_table(errors, cell, scalars, updates.get(cell, []), UPDATES, lambda r: r["chunk"],
                               "policy_updates.parquet")
        if not any(t.startswith("time/") for t in scalars):
            errors.append(f"{cell}: no time/* scalars")
        if chunked and (run / "rounds.parquet").exists():
            chunks = {r["chunk"] for r in rows}
            got = tensors.get("completions", [])
            if set(got) != chunks or len(got) != len(set(got)):
                errors.append(f"{cell}: completions at steps {sorted(got)}, expected one per chunk {sorted(chunks)}")
            texts += len(got)
    extra = sorted(p.name for p in (run / "tb").iterdir() if p.name not in metrics) if (run / "tb").is_dir() else []
    if extra:
        errors.append(f"tb/: directories of no cell of metrics.parquet: {extra[:5]}")
    if errors:
        print("\n".join(errors[:40]), file=sys.stderr)
        sys.exit(f"check_tensorboard: {run}: {len(errors)} mismatch(es)")
    print(f"check_tensorboard: {run}: {len(metrics)} cells, {checked} scalars equal to the tables, {texts} completion texts")


if __name__ == "__main__":
    main()
