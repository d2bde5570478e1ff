# %% [markdown]
# # Loading onepass results
#
# A percent-format notebook (open it in Jupyter with jupytext, or in VS Code / PyCharm as cells;
# `python3 notebooks/load-results.py RUN_DIR` runs it top to bottom, as CI does on the mini-hh-ci
# run). It loads a run directory's parquet tables with **pandas** and with **polars**, checks that
# both read the same numbers, and redraws the held-out accuracy figure (mean ± 1 std over seeds)
# with matplotlib.
#
# A run directory holds: `metrics.parquet` (one row per cell and evaluation point),
# `cells.parquet` (one row per cell: estimator, label, seed, hyper-parameters, status),
# `timings.parquet`, optional `steps.parquet`, `theta/<cell_id>.npy`, `meta.json` (git revision,
# versions, data report), `spec.resolved.toml` and `schema.json`.

# %%
import json
import os
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import polars as pl

args = [a for a in sys.argv[1:] if not a.startswith("-")]
RUN = pathlib.Path(args[0] if args else os.environ.get("ONEPASS_RUN", "results/latest"))
assert (RUN / "metrics.parquet").exists(), f"{RUN}: not a onepass run directory (pass one as argument or ONEPASS_RUN)"
meta = json.loads((RUN / "meta.json").read_text())
print(f"run {RUN.name}: setting {meta['setting']}, {meta['cells']} cells, git {meta['git_revision'][:12]}")

# %% [markdown]
# ## pandas

# %%
metrics = pd.read_parquet(RUN / "metrics.parquet")
cells = pd.read_parquet(RUN / "cells.parquet")
final = metrics.sort_values("step").groupby(["label", "seed"]).last().reset_index()
table = final.groupby("label")[["eval_accuracy", "eval_loss"]].agg(["mean", "std", "count"])
print(table.round(4).to_string())

# %% [markdown]
# ## Hyper-parameters: one typed `hp.<key>` column each
#
# cells.parquet has a column per hyper-parameter of any config in the run (`hp.lr`, `hp.eta`, …;
# numbers as numbers, null for an estimator without that key; a key mixing numbers and words, as
# λ = "auto" and 2.0, is text), so a sweep groups by its key directly. `hparams` keeps the whole
# config as one JSON object with typed values.

# %%
hp = [c for c in cells.columns if c.startswith("hp.")]
print("hyper-parameter columns:", {c: str(cells[c].dtype) for c in hp})
by_cell = final.merge(cells[["cell_id", *hp]], on="cell_id")
numeric = [c for c in hp if pd.api.types.is_numeric_dtype(cells[c])]
if numeric:
    print(by_cell.groupby(["estimator", numeric[0]], dropna=False)["eval_accuracy"].mean().round(4).to_string())
assert all(isinstance(v, (int, float, str, bool)) for v in json.loads(cells["hparams"].iloc[0]).values())

# %% [markdown]
# ## polars: the same numbers

# %%
pm = pl.read_parquet(RUN / "metrics.parquet")
pfinal = (
    pm.sort("step")
    .group_by(["label", "seed"], maintain_order=True)
    .last()
    .group_by("label")
    .agg(pl.col("eval_accuracy").mean().alias("acc_mean"), pl.col("eval_accuracy").std().alias("acc_std"))
    .sort("label")
)
print(pfinal)
for row in pfinal.iter_rows(named=True):
    m = table.loc[row["label"], ("eval_accuracy", "mean")]
    assert abs(m - row["acc_mean"]) < 1e-12, (row["label"], m, row["acc_mean"])
assert pm.height == len(metrics)

# %% [markdown]
# ## The held-out accuracy figure, redrawn

# %%
curves = metrics.groupby(["label", "samples_seen"])["eval_accuracy"].agg(["mean", "std"]).reset_index()
fig, ax = plt.subplots(figsize=(8, 5))
for label, g in curves.groupby("label"):
    sd = g["std"].fillna(0.0)
    ax.plot(g["samples_seen"], g["mean"], label=label, lw=2)
    ax.fill_between(g["samples_seen"], g["mean"] - sd, g["mean"] + sd, alpha=0.15)
ax.set_xlabel("samples seen")
ax.set_ylabel("eval accuracy")
ax.set_title(f"{RUN.name}: held-out accuracy (mean ± 1 std over seeds)")
ax.legend(fontsize=8)
out = RUN / "report" / "eval_accuracy.notebook.png"
out.parent.mkdir(exist_ok=True)
fig.savefig(out, dpi=110, bbox_inches="tight")
print(f"wrote {out}")

# %% [markdown]
# ## A learned head and its held-out scores
#
# θ of a cell is a 1-D float64 .npy; `onepass report` also exports each config's first-seed head
# as `report/heads/<label>.safetensors` (`score.weight`, shape [1, d]).

# %%
cell = cells.iloc[0]
theta = np.load(RUN / "theta" / f"{cell['cell_id']}.npy")
assert theta.ndim == 1 and np.isfinite(theta).all()
print(f"{cell['label']} seed {cell['seed']}: θ of dimension {theta.shape[0]}, ‖θ‖ = {np.linalg.norm(theta):.4f}")
