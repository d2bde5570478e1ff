# %% [markdown]
# # Passive data collection: the learning curves of a run
#
# The paper's Fig. 2 for one of your runs: training loss, training accuracy, held-out loss and
# held-out accuracy against the number of preference samples seen, and — when the run knows the
# true θ* (the synthetic bandit) — the error ‖θ_t − θ*‖ and the suboptimality of the greedy
# policy. One line per estimator label (`cells.parquet`'s `label`: the estimator kind, plus its
# swept hyper-parameters), the mean over seeds with a ±1 std band.
#
# ```
# pip install pandas pyarrow matplotlib          # polars is optional; this notebook uses pandas
# python3 notebooks/passive.py RUN_DIR           # e.g. the last line `just reproduce-passive synthetic` prints
# ```
#
# A percent-format notebook: `jupytext --to ipynb notebooks/passive.py`, or open it as cells in
# VS Code / PyCharm. In Jupyter, set `ONEPASS_RUN=RUN_DIR` (else the newest passive run under
# `results/` is taken). It writes `RUN_DIR/notebook-passive.png` and prints the table it drew from.

# %%
import json
import os
import pathlib
import sys

import matplotlib

if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")  # a script: draw to the file only
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from onepass_runs import load, over  # noqa: E402 (beside this notebook)

SETTING = "passive"
RUN, meta, metrics, cells = load(SETTING)
print(f"run {RUN}: {meta['cells']} cells, git {meta['git_revision'][:12]}, {metrics['seed'].nunique()} seed(s)")

# %% [markdown]
# ## Which cells finished
#
# A failed cell has no metric rows; `cells.parquet` keeps its error. (Its `hparams` column holds
# the estimator's hyper-parameters; the label already names the swept ones, so we group by
# `label` and leave `hparams` alone.)

# %%
failed = cells[cells["status"] != "ok"]
if len(failed):
    print(f"{len(failed)} failed cell(s):")
    print(failed[["cell_id", "label", "seed", "err"]].to_string(index=False))
print(cells.groupby("label", sort=False)["seed"].count().rename("seeds").to_string())

# %% [markdown]
# ## The curves: mean ± 1 std over seeds per label and samples seen
#
# `train_*` are prequential (each sample scored before the update), averaged since the previous
# evaluation point; `eval_*` are on the held-out pairs. θ error and SubOpt exist only where the
# run has a θ* (empty columns otherwise, and their panels are left out).

# %%
PANELS = [
    ("train_loss", "training loss"),
    ("train_accuracy", "training accuracy"),
    ("eval_loss", "held-out loss"),
    ("eval_accuracy", "held-out accuracy"),
    ("theta_err", "‖θ − θ*‖₂"),
    ("subopt", "SubOpt (greedy policy)"),
]
panels = [(c, t) for c, t in PANELS if c in metrics and metrics[c].notna().any()]
labels = list(dict.fromkeys(metrics["label"]))  # the spec's order
curves = (
    metrics.groupby(["label", "samples_seen"])[[c for c, _ in panels]]
    .agg(["mean", "std"])
    .reset_index()
)

ncols = 3 if len(panels) > 4 else 2
nrows = -(-len(panels) // ncols)
fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.9 * nrows), squeeze=False)
colors = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")
for k, (ax, (col, title)) in enumerate(zip(axes.flat, panels)):
    for i, label in enumerate(labels):
        g = curves[curves["label"] == label]
        mean, sd = g[(col, "mean")], g[(col, "std")].fillna(0.0)
        ax.plot(g["samples_seen"], mean, color=colors(i), lw=1.8, label=label)
        ax.fill_between(g["samples_seen"], mean - sd, mean + sd, color=colors(i), alpha=0.15, lw=0)
    ax.set_title(f"({'abcdef'[k]}) {title}")
    ax.set_xlabel("samples seen")
    ax.set_ylabel(title)
    ax.grid(alpha=0.3)
    v = metrics[col].dropna()
    # log scale where a transient (an early divergence) would flatten the other curves
    if (v > 0).all() and (col in ("theta_err", "subopt") or v.max() > 5 * v.median()):
        ax.set_yscale("log")
for ax in axes.flat[len(panels) :]:
    ax.set_visible(False)
seeds = metrics["seed"].nunique()
fig.suptitle(f"{RUN.name}: passive data collection, {over(seeds)}")
handles, names = axes.flat[0].get_legend_handles_labels()
fig.legend(handles, names, loc="lower center", ncol=min(len(labels), 5), frameon=False)
fig.tight_layout(rect=(0, 0.04 + 0.035 * ((len(labels) - 1) // 5), 1, 0.97))
out = RUN / "notebook-passive.png"
fig.savefig(out, dpi=110)
print(f"wrote {out}")

# %% [markdown]
# ## The table behind the figure: the last evaluation point
#
# Per label, mean and std over seeds of each panel's value at the last evaluation point, and the
# pessimistic policy's SubOpt (the paper's Alg. 2 output; final row only) where the run has a θ*.

# %%
final = metrics.sort_values("samples_seen").groupby(["label", "seed"], sort=False).last().reset_index()
cols = [c for c, _ in panels] + [
    c for c in ("subopt_pessimistic",) if c in final and final[c].notna().any()
]
table = final.groupby("label")[cols].agg(["mean", "std"]).reindex(labels)
table.insert(0, ("samples_seen", ""), final.groupby("label")["samples_seen"].max())
table.insert(1, ("seeds", ""), final.groupby("label")["seed"].nunique())
with pd.option_context("display.width", 200, "display.max_columns", 40):
    print(table.round(4).to_string())
