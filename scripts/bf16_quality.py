#!/usr/bin/env python3
"""Issue 20's quality bar for phi: per-sequence cosine between the bf16 and the f32 features of the
same pairs (two `onepass features extract --out` parquets: phi_chosen, phi_rejected, label).
Prints the minimum, the 1st percentile and the median cosine and how many sequences fall below 0.999;
exits 1 if any does. Usage: bf16_quality.py F32.parquet BF16.parquet"""
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


if __name__ == "__main__":
    main(*sys.argv[1:3])
