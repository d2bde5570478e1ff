#!/usr/bin/env python3
"""Issue 20's quality bar for bf16 against f32.
  bf16_quality.py F32.parquet BF16.parquet   per-sequence cosine between the features of the same pairs
      (two `onepass features extract --out` parquets: phi_chosen, phi_rejected, label): minimum, 1st
      percentile, median, and how many fall below 0.999 (exit 1 if any).
  bf16_quality.py --runs F32_RUN BF16_RUN     final held-out accuracy per config (mean over seeds) of two
      run directories of one preset, and the largest difference (exit 1 above 0.01)."""
import sys

import numpy as np
import pyarrow.parquet as pq


def load(path):
    t = pq.read_table(path)
    return np.concatenate([np.stack(t.column(c).to_numpy(zero_copy_only=False)) for c in ("phi_chosen", "phi_rejected")])


def main(a, b):
    x, y = load(a).astype(np.float64), load(b).astype(np.float64)
    if x.shape != y.shape:
        sys.exit(f"{a} has {x.shape}, {b} has {y.shape}: not the same pairs")
    cos = (x * y).sum(1) / np.linalg.norm(x, axis=1) / np.linalg.norm(y, axis=1)
    rel = np.linalg.norm(x - y, axis=1) / np.linalg.norm(x, axis=1)
    below = int((cos < 0.999).sum())
    print(f"{len(cos)} sequences: cosine min {cos.min():.6f}, 1st percentile {np.percentile(cos, 1):.6f}, "
          f"median {np.median(cos):.6f}; relative L2 error median {np.median(rel):.4f}, max {rel.max():.4f}; "
          f"{below} below 0.999")
    sys.exit(1 if below else 0)


def runs(a, b):
    import pandas as pd

    def final(run):
        m = pd.read_parquet(f"{run}/metrics.parquet")
        last = m.sort_values("step").groupby(["label", "seed"]).last().reset_index()
        return last.groupby("label")["eval_accuracy"].mean()

    fa, fb = final(a), final(b)
    worst = 0.0
    for label in fa.index:
        d = fb[label] - fa[label]
        worst = max(worst, abs(d))
        print(f"{label:<24} f32 {fa[label]:.4f}  bf16 {fb[label]:.4f}  difference {d:+.4f}")
    print(f"largest difference {worst:.4f}")
    sys.exit(1 if worst > 0.01 else 0)


if __name__ == "__main__":
    if sys.argv[1] == "--runs":
        runs(*sys.argv[2:4])
    else:
        main(*sys.argv[1:3])
