"""Reads a onepass run directory with pandas and polars, as a notebook would, and checks the
basics (CI runs it on a freshly produced run). Usage: python3 scripts/read_results.py RUN_DIR"""
import json
import pathlib
import sys

import numpy as np
import pandas as pd
import polars as pl

run = pathlib.Path(sys.argv[1])
metrics = pd.read_parquet(run / "metrics.parquet")
cells = pl.read_parquet(run / "cells.parquet")
schema = json.loads((run / "schema.json").read_text())
assert list(metrics.columns) == [c[0] for c in schema["metrics.parquet"]], "metrics columns match schema.json"
assert cells.height == json.loads((run / "meta.json").read_text())["cells"]
final = metrics.sort_values("step").groupby(["label", "seed"]).last().reset_index()
table = final.groupby("label")[["eval_accuracy", "theta_err", "subopt"]].agg(["mean", "std"])
print(table.to_string())
theta = np.load(run / "theta" / f"{cells['cell_id'][0]}.npy")
assert theta.ndim == 1 and np.isfinite(theta).all()
print(f"read {len(metrics)} metric rows, {cells.height} cells, theta of dimension {theta.shape[0]}")
policy = run / "policy.parquet"
if policy.exists():
    # a run whose policy learns: one evaluation per cell and chunk; at chunk 0 every arm of a
    # seed holds the base policy's samples of that seed's held-out streams
    p = pd.read_parquet(policy)
    assert list(p.columns) == [c[0] for c in schema["policy.parquet"]], "policy columns match schema.json"
    start = p[p.chunk == 0].groupby("seed").sample_reward.nunique()
    assert (start == 1).all(), "every arm of a seed starts from the base policy's samples"
    last = p.sort_values("chunk").groupby(["policy", "reward", "label", "seed"]).last().reset_index()
    cols = ["policy_reward", "sample_reward", "bon_reward", "kl"]
    print(last.groupby(["policy", "reward"])[cols].agg(["mean", "std"]).to_string())
    updates = pd.read_parquet(run / "policy_updates.parquet")
    assert list(updates.columns) == [c[0] for c in schema["policy_updates.parquet"]], "policy_updates columns match"
    print(f"read {len(p)} policy rows")
