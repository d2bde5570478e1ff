#!/usr/bin/env python3
"""Issue 30's table: held-out accuracy after the one pass of passive runs that differ in how the
reward model learns (`[reward] update = "head" | "lora" | "full"`, `hvp`), per estimator, mean ±
sd over seeds, each seed's value, the mean held-out loss and the time per step; then each
variant minus the head-only run of the same estimator and seed (paired over seeds: the same
stream of pairs, checked by cells.parquet's stream_hash, and the same held-out pairs).

    python3 scripts/rm_table.py RUN_DIR [RUN_DIR ...]   # e.g. mini-hh-lora-rm with each update

A run still going (no metrics.parquet yet) is skipped with a line saying so. The paired
difference's "detectable" is 2 × its SE over seeds: a smaller difference is not resolved (a
rough bar: with 3 seeds a two-sided t-test at 5% needs 4.3 × SE).
"""
import pathlib
import re
import sys

import numpy as np
import pandas as pd


def variant(r, estimator):
    """`head`, `lora` or `full` from the run's [reward] table `r`; for the Newton–CG rules also
    how CG's products are formed."""
    update = r.get("update", "head")
    if update == "head" or not estimator.startswith("omd"):
        return update
    return f"{update}/{r.get('hvp', 'central')}"


def reward_table(path):
    """The string keys of the resolved spec's [reward] table (tomllib where Python has it)."""
    text = path.read_text()
    try:
        import tomllib
        return {k: v for k, v in tomllib.loads(text).get("reward", {}).items() if isinstance(v, str)}
    except ImportError:  # Python < 3.11: the resolved spec writes `key = "value"` lines
        m = re.search(r"^\[reward\]\s*$(.*?)(?=^\[|\Z)", text, re.S | re.M)
        return dict(re.findall(r'^(\w+)\s*=\s*"([^"]*)"', m.group(1), re.M)) if m else {}


def se(d):
    return d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")


def load(run):
    m = pd.read_parquet(run / "metrics.parquet")
    last = m.loc[m.groupby(["label", "seed"]).step.idxmax()]
    cells = pd.read_parquet(run / "cells.parquet")[["cell_id", "stream_hash", "status"]]
    t = pd.read_parquet(run / "timings.parquet")
    # the steps' seconds (forward, backward, HVPs) over every process that ran the cell
    per_cell = t.groupby("cell_id").agg(estimator_s=("cell_estimator_s", "max"), wall_s=("cell_wall_s", "max"))
    out = last.merge(cells, on="cell_id", how="left").merge(per_cell, on="cell_id", how="left")
    steps = m.groupby("cell_id").step.max().rename("steps")
    return out.merge(steps, on="cell_id", how="left")


def main(runs):
    rows = []
    for r in map(pathlib.Path, runs):
        if not (r / "metrics.parquet").exists():
            print(f"rm_table: {r}: no metrics.parquet (still running?): skipped")
            continue
        d = load(r)
        reward = reward_table(r / "spec.resolved.toml")
        d["variant"] = [variant(reward, e) for e in d.estimator]
        d["run"] = str(r)
        rows.append(d)
    if not rows:
        sys.exit("rm_table: no finished run among the arguments")
    d = pd.concat(rows, ignore_index=True)
    dup = d[d.duplicated(["variant", "label", "seed"], keep=False)]
    if not dup.empty:
        r = dup.iloc[0]
        runs = sorted(set(dup[(dup.variant == r.variant) & (dup.label == r.label) & (dup.seed == r.seed)].run))
        sys.exit(f"rm_table: {r.variant} {r.label} seed {r.seed} is in more than one run ({', '.join(runs)}): "
                 "give each cell once (a merged run or its slices, not both)")
    w = max(14, d.label.str.len().max())
    print(f"{'variant':<14} {'estimator':<{w}} {'seeds':>5} {'held-out acc':>16}  {'per seed':<24} {'loss':>7} {'s/step':>8}")
    for (v, lab), g in d.groupby(["variant", "label"], sort=True):
        g = g.sort_values("seed")
        acc = g.eval_accuracy
        per = " / ".join(f"{a:.4f}" for a in acc)
        s_step = (g.estimator_s / g.steps).mean()
        print(f"{v:<14} {lab:<{w}} {len(g):>5} {acc.mean():>8.4f} ± {acc.std(ddof=1) if len(g) > 1 else float('nan'):.4f}  "
              f"{per:<24} {g.eval_loss.mean():>7.4f} {s_step:>8.3g}")
    head = d[d.variant == "head"].set_index(["label", "seed"])
    rest = d[d.variant != "head"]
    if head.empty or rest.empty:
        return
    print("\npaired over seeds, minus head-only (same estimator, seed and stream):")
    for (v, lab), g in rest.groupby(["variant", "label"], sort=True):
        g = g.set_index("seed")
        seeds = [s for s in g.index if (lab, s) in head.index]
        if not seeds:
            continue
        h = head.loc[[(lab, s) for s in seeds]].reset_index(level=0, drop=True)
        differ = [s for s in seeds if g.stream_hash[s] != h.stream_hash[s]]
        if differ:
            sys.exit(f"rm_table: {v} {lab}: seeds {differ} read another stream than the head-only run: not paired")
        for col in ["eval_accuracy", "eval_loss"]:
            dd = g.loc[seeds, col] - h[col]
            print(f"  {v:<14} {lab:<{w}} {col:<14} {dd.mean():+.4f} ± {se(dd):.4f} "
                  f"({len(seeds)} seeds; detectable ≈ {2 * se(dd):.4f})")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
