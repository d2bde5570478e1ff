#!/usr/bin/env python3
"""One deployed policy in two deploy runs of the same spec and seeds that differ in one key (e.g.
policy.dtype = "f32" and "bf16"): held-out policy_reward and KL at chunk 0 (the base policy: the
same samples in both runs, checked) and at the last evaluation, each run's change from the base,
and B − A paired over seeds with its paired SE. Also the time split summed over cells.

    python3 scripts/policy_paired.py RUN_A RUN_B [POLICY]   # POLICY default "rloo"
"""
import sys

import numpy as np
import pandas as pd


def load(run, policy):
    p = pd.read_parquet(f"{run}/policy.parquet")
    return p[p.policy == policy]


def at(p, chunk, col):
    return p[p.chunk == chunk].groupby("seed")[col].mean()


def se(d):
    return d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")


def main(a_run, b_run, policy="rloo"):
    a, b = load(a_run, policy), load(b_run, policy)
    if a.empty or b.empty:
        sys.exit(f"policy_paired: no {policy!r} rows in one of the runs")
    last = min(a.chunk.max(), b.chunk.max())
    for col in ["policy_reward", "kl"]:
        a0, b0, al, bl = at(a, 0, col), at(b, 0, col), at(a, last, col), at(b, last, col)
        same = np.allclose(a0.values, b0.values)
        d = (bl - al).dropna()
        print(f"{col}: chunk 0 A {a0.mean():.4f} B {b0.mean():.4f} (the same base: {same}); chunk {last} A {al.mean():.4f} B {bl.mean():.4f}")
        print(f"  A − base {(al - a0).mean():+.4f} ± {se(al - a0):.4f}; B − base {(bl - b0).mean():+.4f} ± {se(bl - b0):.4f}; "
              f"B − A {d.mean():+.4f} ± {se(d):.4f} (paired SE over {len(d)} seeds; detectable ≈ {2 * se(d):.3f})")
    for name, run in [("A", a_run), ("B", b_run)]:
        t = pd.read_parquet(f"{run}/policy_timings.parquet").select_dtypes("number").sum()
        print(name, {k: round(float(v), 1) for k, v in t.items() if k.endswith("_s")})


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(*sys.argv[1:4])
