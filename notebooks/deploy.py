# %% [markdown]
# # Deployment-time adaptation: what each estimator × strategy collected
#
# The paper's Fig. 4 for one of your runs: one panel per estimator, one line per pair-selection
# strategy (the second response shown: ucb, best-quantile, best-two, …), the mean over seeds with a
# ±1 std band, and a last panel that compares every configuration.
#
# * On generated responses (chunked runs: `generate.*`, an oracle labels the pairs) the curves are
#   the cumulative oracle reward of the chosen pairs, Σ over chunks of mean r(a) + r(a′), against
#   the chunk, and the last panel is each configuration's chunk win rate (`winrates.parquet`).
# * On the synthetic bandit they are the cumulative regret Σ r(x, π*) − ½(r(a) + r(a′)) against
#   the rounds, and the last panel is the final regret.
# * When the run closed the loop with a learning policy (`policy.parquet`: best-of-n, rloo, dpo,
#   ppo arms), a second figure shows the oracle reward of what each arm deploys on the held-out
#   prompts per chunk (chunk 0: before any update), with the KL to the initial policy.
#
# ```
# pip install pandas pyarrow matplotlib          # polars is optional; this notebook uses pandas
# python3 notebooks/deploy.py RUN_DIR            # e.g. the last line `just reproduce-deploy synthetic` prints
# ```
#
# A percent-format notebook: `jupytext --to ipynb notebooks/deploy.py`, or open it as cells in
# VS Code / PyCharm. In Jupyter, set `ONEPASS_RUN=RUN_DIR` (else the newest deploy run under
# `results/` is taken). It writes `RUN_DIR/notebook-deploy.png` (and `notebook-deploy-policy.png`)
# and prints the tables it drew from.

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

SETTING = "deploy"
RUN, meta, metrics, cells = load(SETTING)
chunked = "cum_pair_reward" in metrics and metrics["cum_pair_reward"].notna().any()
if chunked:
    assert (RUN / "winrates.parquet").is_file(), f"{RUN / 'winrates.parquet'}: not found in a chunked deploy run"
else:
    assert metrics["regret"].notna().any(), f"{RUN / 'metrics.parquet'}: neither cum_pair_reward nor regret has a value"
print(
    f"run {RUN}: {meta['cells']} cells, git {meta['git_revision'][:12]}, {metrics['seed'].nunique()} seed(s), "
    + ("generated responses (chunked)" if chunked else "synthetic bandit")
)

# %% [markdown]
# ## Which cells finished
#
# A cell's label is `estimator [swept hyper-parameters] / strategy [/ policy arm]`. A failed cell
# has no metric rows; `cells.parquet` keeps its error. We group by `label` and leave the
# `hparams` column alone.

# %%
failed = cells[cells["status"] != "ok"]
if len(failed):
    print(f"{len(failed)} failed cell(s):")
    print(failed[["cell_id", "label", "seed", "err"]].to_string(index=False))
print(cells.groupby("label", sort=False)["seed"].count().rename("seeds").to_string())

# %% [markdown]
# ## The curves: one panel per estimator, one line per strategy

# %%
if chunked:
    x, x_title, y, y_title = "chunk", "chunk", "cum_pair_reward", "Σ over chunks of mean r(a) + r(a′)"
else:
    x, x_title, y, y_title = "samples_seen", "rounds", "regret", "cumulative regret"
# the label's estimator part (before the first " / ") is the panel; the rest names the line
metrics["panel"] = metrics["label"].str.split(" / ", n=1).str[0]
metrics["line"] = metrics["label"].str.split(" / ", n=1).str[1].fillna("")
panels = list(dict.fromkeys(metrics["panel"]))
lines = list(dict.fromkeys(metrics["line"]))
colors = plt.get_cmap("tab10" if len(lines) <= 10 else "tab20")
color = {l: colors(i) for i, l in enumerate(lines)}
curves = metrics.groupby(["panel", "line", x])[y].agg(["mean", "std"]).reset_index()

ncols = min(3, len(panels) + 1)
nrows = -(-(len(panels) + 1) // ncols)
fig, grid = plt.subplots(nrows, ncols, figsize=(5.4 * ncols, 4.3 * nrows), squeeze=False)
axes = list(grid.flat)
for k, (ax, panel) in enumerate(zip(axes, panels)):
    for line in lines:
        g = curves[(curves["panel"] == panel) & (curves["line"] == line)]
        if len(g) == 0:
            continue
        sd = g["std"].fillna(0.0)
        ax.plot(g[x], g["mean"], color=color[line], lw=1.8, marker="o" if chunked else None, ms=3, label=line)
        ax.fill_between(g[x], g["mean"] - sd, g["mean"] + sd, color=color[line], alpha=0.13, lw=0)
    ax.set_title(f"({chr(97 + k)}) {panel}")
    ax.set_xlabel(x_title)
    ax.set_ylabel(y_title)
    ax.grid(alpha=0.3)
    if chunked:
        ax.xaxis.get_major_locator().set_params(integer=True)
# one y range for every estimator: they compare at a glance
lo = min(a.get_ylim()[0] for a in axes[: len(panels)])
hi = max(a.get_ylim()[1] for a in axes[: len(panels)])
for a in axes[: len(panels)]:
    a.set_ylim(lo, hi)

# the last panel: every estimator × strategy at once, as a grid
last = axes[len(panels)]
for a in axes[len(panels) + 1 :]:
    a.set_visible(False)
final = metrics.sort_values(x).groupby(["label", "seed"]).last().reset_index()
order = list(dict.fromkeys(metrics["label"]))
key = metrics.drop_duplicates("label").set_index("label")[["panel", "line"]]
if chunked:
    wins = pd.read_parquet(RUN / "winrates.parquet").set_index("label").reindex(order)
    value, what, cmap = wins["chunk_win_rate"], f"chunk win rate (chance: 1/{len(order)})", "viridis"
else:
    value, what, cmap = final.groupby("label")[y].mean().reindex(order), f"final {y_title}, mean", "viridis_r"
heat = pd.DataFrame({"v": value}).join(key).pivot(index="panel", columns="line", values="v").reindex(index=panels, columns=lines)
im = last.imshow(heat.to_numpy(dtype=float), cmap=cmap, aspect="auto")
last.set_xticks(range(len(lines)), lines, rotation=30, ha="right", fontsize=8)
last.set_yticks(range(len(panels)), panels, fontsize=8)
for (i, j), v in np.ndenumerate(heat.to_numpy(dtype=float)):
    if np.isfinite(v):
        last.text(j, i, f"{v:.2f}" if chunked else f"{v:.0f}", ha="center", va="center", fontsize=8, color="k" if np.dot(im.cmap(im.norm(v))[:3], [0.299, 0.587, 0.114]) > 0.5 else "w")
fig.colorbar(im, ax=last, shrink=0.85)
last.set_title(f"({chr(97 + len(panels))}) {what}", fontsize=10)

seeds = metrics["seed"].nunique()
fig.suptitle(f"{RUN.name}: deployment-time adaptation, {over(seeds)}")
handles, names = axes[0].get_legend_handles_labels()
fig.legend(handles, names, title="strategy / policy arm" if any(" / " in l for l in lines) else "strategy", loc="lower center", ncol=min(len(lines), 6), frameon=False)
fig.tight_layout(rect=(0, (0.1 + 0.04 * ((len(lines) - 1) // 6)) / nrows, 1, 1 - 0.05 / nrows))
out = RUN / "notebook-deploy.png"
fig.savefig(out, dpi=110)
print(f"wrote {out}")

# %% [markdown]
# ## The table behind the figure: the last round or chunk
#
# On generated responses also the deployed policy's mean oracle reward and the Kendall τ between
# learned and oracle rankings in the last chunk, and each configuration's win rates.

# %%
cols = [y] + (["policy_reward", "kendall_tau"] if chunked else ["mean_reward", "subopt"])
cols = [c for c in cols if c in final and final[c].notna().any()]
table = final.groupby("label")[cols].agg(["mean", "std"]).reindex(order)
table.insert(0, (x_title, ""), final.groupby("label")[x].max())
table.insert(1, ("seeds", ""), final.groupby("label")["seed"].nunique())
if chunked:
    table[("chunk_win_rate", "")] = wins["chunk_win_rate"].reindex(table.index)
    table[("prompt_win_rate", "")] = wins["prompt_win_rate"].reindex(table.index)
with pd.option_context("display.width", 220, "display.max_columns", 40):
    print(table.round(4).to_string())

# %% [markdown]
# ## The policy on held-out prompts (runs with a learning policy)
#
# `policy.parquet`: after each chunk, `policy.eval_samples` samples per held-out prompt from each
# arm's current policy, on the seed's own sampling streams (the same for every arm and chunk).
# `policy_reward` is the oracle reward of what the arm deploys — a learning policy's samples,
# best-of-n its pick under θ_t — so arms compare on it; `kl_initial` is the sequence KL to the
# initial policy (0 for arms that do not learn; `kl` is to the KL penalty's reference, which
# `kl_reference = "chunk-start"` moves to the policy after each update).

# %%
if (RUN / "policy.parquet").is_file():
    policy = pd.read_parquet(RUN / "policy.parquet")
    if "kl_initial" not in policy:  # a run written before the column: its kl was to the initial policy only with kl_reference = "initial"
        policy["kl_initial"] = policy["kl"]
    arms = list(dict.fromkeys(policy["label"]))
    pc = policy.groupby(["label", "chunk"])[["policy_reward", "kl_initial"]].agg(["mean", "std"]).reset_index()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    cmap = plt.get_cmap("tab10" if len(arms) <= 10 else "tab20")
    for i, arm in enumerate(arms):
        g = pc[pc["label"] == arm]
        for ax, col in zip(axes, ("policy_reward", "kl_initial")):
            mean, sd = g[(col, "mean")], g[(col, "std")].fillna(0.0)
            ax.plot(g["chunk"], mean, color=cmap(i), lw=1.8, marker="o", ms=3, label=arm)
            ax.fill_between(g["chunk"], mean - sd, mean + sd, color=cmap(i), alpha=0.13, lw=0)
    axes[0].set_ylabel("held-out oracle reward of what the arm deploys")
    axes[0].set_title("policy reward per arm")
    axes[1].set_ylabel("sequence KL to the initial policy")
    axes[1].set_title("KL per arm")
    for ax in axes:
        ax.set_xlabel("chunk (0: before the first update)")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    pseeds = policy["seed"].nunique()
    fig.suptitle(f"{RUN.name}: the deployed policy, {over(pseeds)}")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=min(len(arms), 4), frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0.08 + 0.05 * ((len(arms) - 1) // 4), 1, 0.95))
    out = RUN / "notebook-deploy-policy.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    first = policy[policy["chunk"] == 0].set_index(["label", "seed"])["policy_reward"]
    lastp = policy.sort_values("chunk").groupby(["label", "seed"]).last()
    ptable = pd.DataFrame(
        {
            "chunks": lastp.groupby("label")["chunk"].max(),
            "seeds": lastp.groupby("label").size(),
            "base": first.groupby("label").mean(),
            "last": lastp.groupby("label")["policy_reward"].mean(),
            "last_std": lastp.groupby("label")["policy_reward"].std(),
            "last_minus_base": (lastp["policy_reward"] - first).groupby("label").mean(),
            "kl_last": lastp.groupby("label")["kl_initial"].mean(),
        }
    ).reindex(arms)
    with pd.option_context("display.width", 220, "display.max_columns", 40):
        print(ptable.round(4).to_string())
else:
    print(f"{RUN / 'policy.parquet'}: none (no learning policy in this run)")
