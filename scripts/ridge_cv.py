#!/usr/bin/env python3
"""How much ridge a full-refit logistic MLE wants on some features: repeated random
train/held-out splits of a pairs parquet (`onepass features extract --out`), an independent
numpy Newton solve of  min Σ logistic(zᵀθ) + ridge·t·‖θ‖²  (onepass's `mle` objective).
This chose `ridge` in experiments/passive/mini-hh*.toml on splits other than the presets'.
Usage: ridge_cv.py PAIRS.parquet [--train 600] [--eval 200] [--reps 20]"""
import argparse

import numpy as np
import pyarrow.parquet as pq


def fit(z, lam):
    th = np.zeros(z.shape[1])
    for _ in range(40):
        p = 1 / (1 + np.exp(-(z @ th)))
        g = z.T @ (p - 1) + 2 * lam * th
        h = (z * (p * (1 - p))[:, None]).T @ z + 2 * lam * np.eye(z.shape[1])
        th -= np.linalg.solve(h, g)
    return th


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("pairs")
    ap.add_argument("--train", type=int, default=600)
    ap.add_argument("--eval", type=int, default=200)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    t = pq.read_table(a.pairs).to_pydict()
    z = np.array(t["phi_chosen"], dtype=np.float64) - np.array(t["phi_rejected"], dtype=np.float64)
    if "degenerate" in t:
        z = z[~np.array(t["degenerate"])]
    rng = np.random.default_rng(a.seed)
    for ridge in [0.001, 0.01, 0.05, 0.1, 0.3, 1.0]:
        accs = []
        for _ in range(a.reps):
            idx = rng.permutation(len(z))
            tr, ev = idx[: a.train], idx[a.train : a.train + a.eval]
            m = z[ev] @ fit(z[tr], ridge * a.train)
            accs.append(((m > 0) + 0.5 * (m == 0)).mean())
        print(f"ridge {ridge:<6} (ridge·t = {ridge * a.train:>6.0f}): {np.mean(accs):.3f} ± {np.std(accs):.3f} held-out accuracy, min {np.min(accs):.3f}")


if __name__ == "__main__":
    main()
