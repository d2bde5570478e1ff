#!/usr/bin/env python3
"""Recompute a run's policy comparisons independently and check the report's.

    python3 scripts/check_policy_stats.py RUN

`onepass report RUN` writes RUN/report/policy_comparisons.csv (the policy table's numbers, which
the book's summaries copy through scripts/policy_results.py). This script computes the same
comparisons again from the run's own tables, with pandas and scipy.stats instead of the
report's Rust code, and fails naming the first row that disagrees:

- per seed, the base is the chunk-0 evaluation (`sample_reward`: the base policy's own samples on
  the seed's streams) and the arm's value its last evaluation (`policy_reward`); an arm against
  the base is d = last − base per seed; two arms of one estimator × strategy, or one arm under
  two estimators (or strategies), are d = last_a − last_b per seed;
- mean, SE = sd(d)/√n (ddof 1), the 95 % t-interval with df = n − 1, the two-sided p and the
  difference detectable at 80 % power, (t₀.₉₇₅ + t₀.₈₀)·SE, against scipy's t distribution;
- the seeds × prompts interval: a pigeonhole bootstrap (seeds and prompts resampled
  independently, Owen 2007) drawn here with numpy's own generator, 20,000 resamples, from
  policy_samples.parquet's per-prompt means; the report's 2.5 % endpoint (4,000 resamples from
  another stream) must lie between this distribution's 1.5 % and 3.5 % quantiles, its 97.5 %
  endpoint between the 96.5 % and 98.5 % ones (±4 Monte-Carlo standard errors of a quantile
  drawn from 4,000 resamples; in probability, so it also holds where a small grid makes the
  resampled means discrete and an endpoint jumps between atoms).

Every comparison the tables imply must be in the CSV and no other. Prints one line per row
checked; exit 1 on the first disagreement, 2 when a table is missing.
"""
import math
import os
import sys

import numpy as np
import pandas as pd
from scipy import stats

RTOL = 1e-9  # the t-based numbers: two implementations of one formula
BOOT_BAND = 0.01  # the bootstrap endpoints: ± this much probability around 2.5 % and 97.5 %
RESAMPLES = 20_000


def fail(msg, code=1):
    print(f"check_policy_stats: {msg}", file=sys.stderr)
    sys.exit(code)


def split(label):
    """(estimator × strategy, arm): the label up to its last " / ", and the rest."""
    g, sep, a = label.rpartition(" / ")
    return (g, a) if sep else ("", label)


def paired(d):
    d = np.asarray(d, dtype=float)
    n = len(d)
    out = {"seeds": n, "mean": d.mean()}
    if n < 2:
        return out | {k: None for k in ("se", "ci95_lo", "ci95_hi", "p", "detectable_80")}
    df = n - 1
    se = d.std(ddof=1) / math.sqrt(n)
    t975 = stats.t.ppf(0.975, df)
    if se > 0:
        p = 2 * stats.t.sf(abs(d.mean() / se), df)
    else:
        p = 1.0 if d.mean() == 0 else 0.0
    return out | {
        "se": se,
        "ci95_lo": d.mean() - t975 * se,
        "ci95_hi": d.mean() + t975 * se,
        "p": p,
        "detectable_80": (t975 + stats.t.ppf(0.80, df)) * se,
    }


def pigeonhole(grid, rng):
    """The resampled means of grid[S*, P*] (S*, P* drawn with replacement), sorted."""
    s, p = grid.shape
    si = rng.integers(0, s, size=(RESAMPLES, s))
    pi = rng.integers(0, p, size=(RESAMPLES, p))
    # mean over the picked cells = mean over picked seeds of (mean over picked prompts)
    return np.sort(np.array([grid[si[r]][:, pi[r]].mean() for r in range(RESAMPLES)]))


def main():
    if len(sys.argv) != 2:
        fail(__doc__.strip().splitlines()[2].strip(), 2)
    run = sys.argv[1]
    paths = {n: os.path.join(run, n) for n in ("policy.parquet", "policy_samples.parquet", "report/policy_comparisons.csv")}
    for n, p in paths.items():
        if not os.path.exists(p):
            fail(f"{p}: not found" + ("; run `onepass report RUN` first" if n.startswith("report") else ""), 2)
    pol = pd.read_parquet(paths["policy.parquet"])
    samples = pd.read_parquet(paths["policy_samples.parquet"])
    csv = pd.read_csv(paths["report/policy_comparisons.csv"], keep_default_na=False, dtype={"group": str, "arm": str, "against": str})

    # per label and seed: base (chunk 0, the policy's own samples) and last (what it deploys)
    first = pol.loc[pol.groupby(["label", "seed"])["chunk"].idxmin()].set_index(["label", "seed"])
    last = pol.loc[pol.groupby(["label", "seed"])["chunk"].idxmax()].set_index(["label", "seed"])
    base = first["sample_reward"].fillna(first["policy_reward"])
    final = last["policy_reward"]

    # per label, seed, prompt: the base's mean over all samples at its first chunk, the arm's
    # mean over its deployed samples at its last chunk
    c0 = samples.groupby(["label", "seed"])["chunk"].transform("min")
    c1 = samples.groupby(["label", "seed"])["chunk"].transform("max")
    grid_base = samples[samples["chunk"] == c0].groupby(["label", "seed", "prompt"])["oracle_reward"].mean()
    dep = samples[(samples["chunk"] == c1) & samples["deployed"]]
    grid_last = dep.groupby(["label", "seed", "prompt"])["oracle_reward"].mean()

    def grid_of(series):
        return series.unstack("prompt").sort_index()

    want = {}
    labels = sorted(final.index.get_level_values("label").unique())
    for label in labels:
        g, a = split(label)
        d = (final.loc[label] - base.loc[label]).sort_index()
        gl = grid_of(grid_last.loc[label]) - grid_of(grid_base.loc[label]) if label in grid_last.index.get_level_values(0) else None
        want[(g, a, "base")] = (paired(d.values), gl, label)
    for i, la in enumerate(labels):
        for lb in labels[i + 1 :]:
            (ga, aa), (gb, ab) = split(la), split(lb)
            if ga == gb:
                key = (ga, aa, ab)
            elif aa == ab:
                key = (aa, ga, gb)
            else:
                continue
            common = final.loc[la].index.intersection(final.loc[lb].index)
            d = (final.loc[la].loc[common] - final.loc[lb].loc[common]).sort_index()
            gl = grid_of(grid_last.loc[la]) - grid_of(grid_last.loc[lb])
            want[key] = (paired(d.values), gl, f"{la} − {lb}")

    have = {(r["group"], r["arm"], r["against"]): r for _, r in csv.iterrows()}
    if set(have) != set(want):
        extra, missing = sorted(set(have) - set(want)), sorted(set(want) - set(have))
        fail(f"{paths['report/policy_comparisons.csv']}: comparisons differ from the tables': in the CSV only {extra}, missing {missing}")

    rng = np.random.default_rng(20251)
    for key in sorted(want):
        p, grid, name = want[key]
        row = have[key]
        for col in ("seeds", "mean", "se", "ci95_lo", "ci95_hi", "p", "detectable_80"):
            ours, theirs = p[col], row[col]
            if ours is None:
                if theirs != "":
                    fail(f"{name}: {col} is {theirs} in the CSV; one seed has none")
                continue
            t = float(theirs)
            if not math.isclose(ours, t, rel_tol=RTOL, abs_tol=1e-12):
                fail(f"{name}: {col} {t!r} in the CSV, {float(ours)!r} recomputed")
        boot = ""
        if p["seeds"] >= 2 and grid is not None and grid.shape[1] >= 2:
            g = grid.to_numpy()
            if np.isnan(g).any():
                fail(f"{name}: a seed × prompt cell has no sample")
            if not math.isclose(g.mean(), p["mean"], rel_tol=1e-9, abs_tol=1e-12):
                fail(f"{name}: the per-prompt grid's mean {g.mean()} is not the seed-level mean {p['mean']}")
            means = pigeonhole(g, rng)
            if int(row["prompts"]) != g.shape[1]:
                fail(f"{name}: prompts {row['prompts']} in the CSV, {g.shape[1]} in policy_samples.parquet")
            for col, q in (("boot95_lo", 0.025), ("boot95_hi", 0.975)):
                a = np.quantile(means, q - BOOT_BAND, method="lower")
                b = np.quantile(means, q + BOOT_BAND, method="higher")
                if not a - 1e-12 <= float(row[col]) <= b + 1e-12:
                    fail(f"{name}: {col} {row[col]} in the CSV, outside the recomputed {q - BOOT_BAND:.3f}–{q + BOOT_BAND:.3f} quantiles [{a:.6f}, {b:.6f}]")
            lo, hi = np.quantile(means, 0.025), np.quantile(means, 0.975)
            boot = f", bootstrap [{lo:+.3f}, {hi:+.3f}] ({g.shape[0]}×{g.shape[1]})"
        elif row["boot95_lo"] != "":
            fail(f"{name}: a bootstrap interval in the CSV where none can be drawn")
        print(f"ok  {name}: {p['mean']:+.4f} over {p['seeds']} seed(s){boot}")
    print(f"check_policy_stats: {len(want)} comparisons of {run} agree with report/policy_comparisons.csv")


if __name__ == "__main__":
    main()
