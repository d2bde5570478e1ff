# %% [markdown]
# # Active data collection: what each query bought
#
# The paper's Fig. 3 for one of your runs: (a) training loss, (b) the suboptimality of the greedy
# policy against the number of labels queried — or, on real features where no θ* is known, the
# held-out accuracy — and (c) the final value with each configuration's wall time. One line per
# configuration label (the estimator, plus its swept hyper-parameters and, when a run compares
# rules, `/ rule`), the mean over seeds with a ±1 std band.
#
# ```
# pip install pandas pyarrow matplotlib          # polars is optional; this notebook uses pandas
# python3 notebooks/active.py RUN_DIR            # e.g. the last line `just reproduce-active synthetic` prints
# ```
#
# A percent-format notebook: `jupytext --to ipynb notebooks/active.py`, or open it as cells in
# VS Code / PyCharm. In Jupyter, set `ONEPASS_RUN=RUN_DIR` (else the newest active run under
# `results/` is taken). It writes `RUN_DIR/notebook-active.png` and prints the table it drew from.

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

SETTING = "active"
RUN, meta, metrics, cells = load(SETTING, ("metrics.parquet", "cells.parquet", "timings.parquet"))
timings = pd.read_parquet(RUN / "timings.parquet")
print(f"run {RUN}: {meta['cells']} cells, git {meta['git_revision'][:12]}, {metrics['seed'].nunique()} seed(s)")

# %% [markdown]
# ## Which cells finished
#
# `strategy` holds the cell's selection rule (pool-argmax, stream or random). A failed cell has
# no metric rows; `cells.parquet` keeps its error. We group by `label` and leave the `hparams`
# column alone.

# %%
failed = cells[cells["status"] != "ok"]
if len(failed):
    print(f"{len(failed)} failed cell(s):")
    print(failed[["cell_id", "label", "seed", "err"]].to_string(index=False))
print(cells.groupby(["label", "strategy"], sort=False)["seed"].count().rename("seeds").to_string())

# %% [markdown]
# ## The curves
#
# With a θ* (the synthetic bandit) the main panel is SubOpt of the greedy policy under the last
# iterate θ_t (solid) and under the averaged iterate (1/t Σ θ_s, dashed; the paper's Alg. 3
# output); on real features it is the held-out accuracy. `samples_seen` counts the labels the
# learner asked for. Wall time is each cell's total (`timings.parquet`, `cell_wall_s`): one
# number per cell, averaged over seeds.

# %%
has_theta = "subopt" in metrics and metrics["subopt"].notna().any()
main, main_title = ("subopt", "SubOpt (greedy policy)") if has_theta else ("eval_accuracy", "held-out accuracy")
cols = ["train_loss", main] + (["subopt_avg"] if has_theta and metrics["subopt_avg"].notna().any() else [])
labels = list(dict.fromkeys(metrics["label"]))
curves = metrics.groupby(["label", "samples_seen"])[cols].agg(["mean", "std"]).reset_index()
wall = timings.groupby("cell_id").first()[["label", "cell_wall_s"]].groupby("label")["cell_wall_s"].mean()

fig, axes = plt.subplots(1, 3, figsize=(16, 4.6), gridspec_kw={"width_ratios": [1, 1, 0.9]})
colors = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")


def band(ax, g, col, color, **kw):
    mean, sd = g[(col, "mean")], g[(col, "std")].fillna(0.0)
    ax.plot(g["samples_seen"], mean, color=color, lw=1.8, **kw)
    ax.fill_between(g["samples_seen"], mean - sd, mean + sd, color=color, alpha=0.13, lw=0)


for i, label in enumerate(labels):
    g = curves[curves["label"] == label]
    band(axes[0], g, "train_loss", colors(i), label=label)
    band(axes[1], g, main, colors(i), label=label)
    if "subopt_avg" in cols:
        band(axes[1], g, "subopt_avg", colors(i), ls="--")
axes[0].set_title("(a) training loss")
axes[0].set_ylabel("training loss (prequential)")
axes[1].set_title(f"(b) {main_title}" + (": last iterate —, averaged iterate - -" if "subopt_avg" in cols else ""))
axes[1].set_ylabel(main_title)
if has_theta and (metrics[main] > 0).all():
    axes[1].set_yscale("log")
for ax in axes[:2]:
    ax.set_xlabel("labels queried")
    ax.grid(alpha=0.3)

final = metrics.sort_values("samples_seen").groupby(["label", "seed"]).last().reset_index()
fin = final.groupby("label")[main].agg(["mean", "std"]).reindex(labels)
y = np.arange(len(labels))
axes[2].barh(y, fin["mean"], xerr=fin["std"].fillna(0.0), color=[colors(i) for i in range(len(labels))], alpha=0.8)
axes[2].set_yticks(y, [f"{label}\n{wall.get(label, np.nan):.2f} s a cell" for label in labels], fontsize=8)
axes[2].invert_yaxis()
if main == "eval_accuracy" and (fin["mean"] > 0.5).all():
    axes[2].set_xlim(left=0.5)  # chance
axes[2].set_xlabel(f"final {main_title} (mean ± 1 std)")
axes[2].set_title("(c) final value, and wall time per cell")
axes[2].grid(alpha=0.3, axis="x")

seeds = metrics["seed"].nunique()
rules = ", ".join(dict.fromkeys(metrics["strategy"].dropna()))
fig.suptitle(f"{RUN.name}: active data collection ({rules}), {over(seeds)}")
handles, names = axes[0].get_legend_handles_labels()
fig.legend(handles, names, loc="lower center", ncol=min(len(labels), 6), frameon=False)
fig.tight_layout(rect=(0, 0.07 + 0.04 * ((len(labels) - 1) // 6), 1, 0.96))
out = RUN / "notebook-active.png"
fig.savefig(out, dpi=110)
print(f"wrote {out}")

# %% [markdown]
# ## The table behind the figure: the last evaluation point

# %%
table = final.groupby("label")[cols + ["eval_accuracy"] * (main != "eval_accuracy")].agg(["mean", "std"]).reindex(labels)
table.insert(0, ("labels_queried", ""), final.groupby("label")["samples_seen"].max())
table.insert(1, ("seeds", ""), final.groupby("label")["seed"].nunique())
table[("cell_wall_s", "mean")] = wall.reindex(table.index)
with pd.option_context("display.width", 200, "display.max_columns", 40):
    print(table.round(4).to_string())
