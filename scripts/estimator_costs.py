#!/usr/bin/env python3
"""The reward model's cost per chunk in an online run, one row per estimator, for a committed
summary (docs/results/*.csv):

    python3 scripts/estimator_costs.py RUN --command "just reproduce-deploy online-estimators" \
        [--cpu "…"] [--wall "…"] [--out docs/results/online-estimators-cost.csv]

Reads RUN/policy_timings.parquet (`estimator_s`: seconds inside the reward model's update, per
cell × chunk) and RUN/metrics.parquet (`estimator_bytes`: the estimator's state after each
chunk), and RUN/meta.json (revision, date). The estimator is the label's part before its first
" / " (the config's estimator and its hyper-parameters). Per estimator: the cells (seeds), the
mean and the standard deviation over cells of the seconds per chunk (each cell's mean over its
update chunks), the seconds of the last chunk (a re-fit grows with the labels), and the state's
bytes after the first and after the last chunk. Timings are wall clock of the machines that ran
the cells (a merged run's slices may come from several): read them as orders of magnitude
between estimators, not as benchmarks.
"""
import argparse
import csv
import json
import os
import statistics
import sys


def costs(timings, metrics):
    """Rows (estimator, cells, s_mean, s_sd, s_last, bytes_first, bytes_last) from the two
    tables as lists of dicts (the columns named in the docstring)."""
    per_cell = {}
    for r in timings:
        if r["chunk"] == 0:
            continue  # chunk 0 is the evaluation before any update
        per_cell.setdefault((r["label"], r["seed"]), []).append((r["chunk"], r["estimator_s"]))
    nbytes = {}
    for r in metrics:
        if r.get("estimator_bytes") is None:
            continue
        nbytes.setdefault((r["label"], r["seed"]), []).append((r["samples_seen"], r["estimator_bytes"]))
    by_est = {}
    for (label, seed), xs in per_cell.items():
        est = label.split(" / ")[0]
        xs.sort()
        b = sorted(nbytes.get((label, seed), []))
        by_est.setdefault(est, []).append((statistics.fmean(s for _, s in xs), xs[-1][1],
                                           b[0][1] if b else None, b[-1][1] if b else None))
    out = []
    for est, cells in sorted(by_est.items()):
        means = [c[0] for c in cells]
        sd = statistics.stdev(means) if len(means) > 1 else 0.0
        firsts = [c[2] for c in cells if c[2] is not None]
        lasts = [c[3] for c in cells if c[3] is not None]
        out.append((est, len(cells), statistics.fmean(means), sd, statistics.fmean(c[1] for c in cells),
                    max(firsts) if firsts else None, max(lasts) if lasts else None))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run")
    ap.add_argument("--command", required=True)
    ap.add_argument("--cpu", required=True, help="the machine(s) that ran the cells")
    ap.add_argument("--wall", default="")
    ap.add_argument("--out")
    a = ap.parse_args()
    import pyarrow.parquet as pq

    try:
        meta = json.load(open(os.path.join(a.run, "meta.json")))
        timings = pq.read_table(os.path.join(a.run, "policy_timings.parquet")).to_pylist()
        metrics = pq.read_table(os.path.join(a.run, "metrics.parquet"), columns=["label", "seed", "samples_seen", "estimator_bytes"]).to_pylist()
    except (OSError, ValueError) as e:
        sys.exit(f"estimator_costs: {a.run}: {e}")
    if meta.get("git_dirty") not in ("false", False):
        sys.exit(f"estimator_costs: {a.run}: made by a build with uncommitted changes: a summary needs a committed revision")
    date, rev = meta["finished"][:10], meta["git_revision"][:7]
    header = ["date", "revision", "cpu", "command", "wall_time", "estimator", "cells", "estimator_s_per_chunk",
              "sd_over_cells", "estimator_s_last_chunk", "state_bytes_first_chunk", "state_bytes_last_chunk"]
    rows = [[date, rev, a.cpu, a.command, a.wall, est, n, f"{m:.3f}", f"{sd:.3f}", f"{last:.3f}",
             "" if b0 is None else b0, "" if b1 is None else b1]
            for est, n, m, sd, last, b0, b1 in costs(timings, metrics)]
    if not rows:
        sys.exit(f"estimator_costs: {a.run}: no update chunks in policy_timings.parquet")
    w = csv.writer(open(a.out, "w", newline="") if a.out else sys.stdout, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)


if __name__ == "__main__":
    main()
