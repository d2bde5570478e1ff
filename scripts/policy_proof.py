#!/usr/bin/env python3
"""The policy-level claim of a deploy run with reward sources (deploy/online-proof), read from its
parquet files: does the policy learn from the learned reward, against a ceiling (oracle reward)
and a floor (null reward)?

    python3 scripts/policy_proof.py RUN_DIR

Prints, on the held-out prompts (policy.parquet's policy_reward: what each arm deploys), per arm
the base policy (chunk 0: the same prompts and sampling streams as every later evaluation of that
seed) and the last evaluation, then paired differences over seeds (same seed: same prompts,
streams, θ's labels up to the arm's own samples) with their paired standard errors and the
minimum detectable difference (2 paired SE); θ's held-out accuracy per chunk (metrics.parquet);
whether every learning cell's policy digest changed at every chunk (policy_updates.parquet).
"""
import sys
from pathlib import Path

import numpy as np
import pandas as pd


def arm(row):
    return f"{row['policy']} ({row['reward']})" if row["policy"] in ("rloo", "ppo") else row["policy"]


def paired(a: pd.Series, b: pd.Series):
    d = (a - b).dropna()
    se = d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
    return d.mean(), se, len(d)


def main(run: Path) -> None:
    p = pd.read_parquet(run / "policy.parquet")
    p["arm"] = p.apply(arm, axis=1)
    last_chunk = p.chunk.max()
    base = p[p.chunk == 0].pivot_table(index="seed", columns="arm", values="policy_reward")
    last = p[p.chunk == last_chunk].pivot_table(index="seed", columns="arm", values="policy_reward")
    # every arm of a seed starts from the same base samples: one base per seed
    base_seed = p[p.chunk == 0].groupby("seed").sample_reward.agg(["min", "max"])
    assert (base_seed["min"] == base_seed["max"]).all(), "arms of a seed differ at chunk 0"
    print(f"{run.name}: {p.seed.nunique()} seeds, last chunk {last_chunk}\n")
    print("held-out policy_reward (mean over seeds)")
    print(pd.DataFrame({"base (chunk 0)": base.mean(), f"chunk {last_chunk}": last.mean()}).round(4).to_string())
    base_policy = p[p.chunk == 0].groupby("seed").sample_reward.first()
    print("\npaired differences at the last chunk (mean ± paired SE over seeds; detectable = 2 SE)")
    rows = []
    comparisons = [(a, "base") for a in last.columns] + [
        ("rloo (learned)", "rloo (null)"),
        ("rloo (oracle)", "rloo (learned)"),
        ("rloo (learned)", "best-of-n"),
        ("dpo", "rloo (null)"),
    ]
    for a, b in comparisons:
        if a not in last.columns or (b != "base" and b not in last.columns):
            continue
        other = base_policy if b == "base" else last[b]
        m, se, n = paired(last[a], other)
        rows.append({"difference": f"{a} − {b}", "mean": m, "paired SE": se, "seeds": n,
                     "t": m / se if se > 0 else float("nan"), "detectable": 2 * se})
    print(pd.DataFrame(rows).round(4).to_string(index=False))
    m = pd.read_parquet(run / "metrics.parquet")
    m["arm"] = m.apply(arm, axis=1)
    acc = m.pivot_table(index="chunk", columns="arm", values="eval_accuracy", aggfunc="mean")
    print("\nθ's held-out accuracy per chunk (mean over seeds)")
    print(acc.round(4).to_string())
    u = pd.read_parquet(run / "policy_updates.parquet")
    u["arm"] = u.apply(arm, axis=1)
    changed = (u.rollout_digest != u.updated_digest) | (u.update_steps == 0)
    print(f"\npolicy digest changed by every update that stepped: {bool(changed.all())} "
          f"({int((u.update_steps > 0).sum())} updates, {int((u.rollout_digest != u.updated_digest).sum())} changed)")
    chain = u.sort_values(["cell_id", "chunk"]).groupby("cell_id").apply(
        lambda g: (g.rollout_digest.iloc[1:].values == g.updated_digest.iloc[:-1].values).all(), include_groups=False)
    print(f"each chunk sampled by the previous update's policy: {bool(chain.all())}")
    print("\nmean update statistics per arm")
    print(u.groupby("arm")[["update_reward", "update_grad_norm", "kl", "dropped_pairs"]].mean().round(4).to_string())
    t = pd.read_parquet(run / "policy_timings.parquet")
    print("\nwall seconds summed over cells")
    print(t[["generation_s", "phi_s", "estimator_s", "policy_s", "eval_s"]].sum().round(0).to_string())


if __name__ == "__main__":
    main(Path(sys.argv[1]))
