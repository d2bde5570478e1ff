#!/usr/bin/env python3
"""Rows of docs/results/ensemble-vs-onepass.csv from finished runs of
experiments/active/ensemble-vs-onepass*.toml: per run and estimator, the final held-out accuracy,
θ-error and SubOpt (mean over seeds with a 95% Student-t half-width, df = seeds − 1), the
estimator's milliseconds per query (timings.parquet's cell_estimator_s over the labels bought),
and its held-out accuracy minus a baseline config's (the first whose label starts with
`--baseline`, default omd-exact), paired by seed, after the provenance columns (date, revision,
cpu, command). It computes nothing else and types no
number: every figure is read from the run directory.

    python3 scripts/ensemble_table.py --cpu "2-core AMD EPYC Zen 3 (AVX2+FMA)" \\
        --command "onepass run experiments/active/ensemble-vs-onepass.toml --threads 1" RUN_DIR \\
        [--command ... RUN_DIR ...] >> docs/results/ensemble-vs-onepass.csv
    python3 scripts/ensemble_table.py --baseline "ensemble / random" --cpu ... --command ... RUN_DIR
    python3 scripts/ensemble_table.py --header   # the header line

With --deploy, rows of docs/results/ensemble-deploy.csv from runs of
experiments/deploy/ensemble-mini*.toml instead: per config (estimator / strategy), the run's wall
time (meta.json's finished − started), the final held-out accuracy and cumulative regret, the
deployed best-of-n's oracle reward averaged over the chunks, the win rate against the base policy
in the last chunk (read from the report's sample-efficiency.csv: run `onepass report RUN_DIR`
first), the estimator's milliseconds and final state (KiB) per query, and held-out accuracy minus
the baseline's paired by seed — the baseline being the config under the same strategy whose
label starts with --baseline (default omd-exact), or the config named exactly by --baseline.

    python3 scripts/ensemble_table.py --deploy --cpu ... --command ... RUN_DIR >> docs/results/ensemble-deploy.csv
    python3 scripts/ensemble_table.py --deploy --header

--note TEXT adds TEXT to each row's note (e.g. "generation and φ cached": what the wall time
covers).

A run directory without metrics.parquet or meta.json stops with one line naming it.
"""
import csv
import json
import math
import pathlib
import sys

import pandas as pd

# two-sided 95% quantiles of Student's t, df = 1..30 (a fixed table)
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042]

HEADER = ["date", "revision", "cpu", "command", "preset", "flip", "estimator", "seeds", "labels",
          "eval_accuracy", "eval_accuracy_ci95", "theta_err", "theta_err_ci95", "subopt", "subopt_ci95",
          "estimator_ms_per_query",
          "baseline", "accuracy_minus_baseline", "accuracy_minus_baseline_ci95", "note"]


def mean_ci(x):
    x = [v for v in x if v == v]
    n = len(x)
    if n == 0:
        return "", ""
    m = sum(x) / n
    if n < 2:
        return f"{m:.4f}", "1 seed"
    sd = math.sqrt(sum((v - m) ** 2 for v in x) / (n - 1))
    t = T975[n - 2] if n - 1 <= len(T975) else 1.960
    return f"{m:.4f}", f"{t * sd / math.sqrt(n):.4f}"


def flip_of(resolved):
    text = resolved.read_text()
    try:
        import tomllib
        return tomllib.loads(text).get("oracle", {}).get("flip", 0.0)
    except ImportError:
        return ""


def rows(run, cpu, command, baseline):
    for f in ["metrics.parquet", "meta.json", "timings.parquet"]:
        if not (run / f).exists():
            sys.exit(f"{run}: no {f} (a finished run directory is expected)")
    meta = json.loads((run / "meta.json").read_text())
    m = pd.read_parquet(run / "metrics.parquet")
    last = m.loc[m.groupby(["label", "seed"]).step.idxmax()]
    t = pd.read_parquet(run / "timings.parquet").groupby("cell_id").cell_estimator_s.max()
    last = last.assign(est_s=last.cell_id.map(t))
    date = meta["finished"][:10]
    dirty = meta.get("git_dirty") not in ("false", False)
    note = "built from a tree with uncommitted changes" if dirty else ""
    preset = pathlib.Path(meta["spec_file"]).stem
    # paired by seed against the baseline config (its label starts with `baseline`)
    base = last[last.label.str.startswith(baseline)]
    base_label = base.label.iloc[0] if len(base) else ""
    omd = base[base.label == base_label].set_index("seed").eval_accuracy
    for label, g in last.groupby("label", sort=False):
        labels = int(g.samples_seen.max())
        acc, acc_ci = mean_ci(list(g.eval_accuracy))
        err, err_ci = mean_ci(list(g.theta_err))
        sub, sub_ci = mean_ci(list(g.subopt))
        ms = 1000 * g.est_s.mean() / labels
        if label == base_label or omd.empty:
            diff, diff_ci = "", ""
        else:
            diff, diff_ci = mean_ci([a - omd[s] for s, a in zip(g.seed, g.eval_accuracy) if s in omd.index])
        yield [date, meta["git_revision"][:7], cpu, command, preset, flip_of(run / "spec.resolved.toml"), label,
               len(g), labels, acc, acc_ci, err, err_ci, sub, sub_ci, f"{ms:.3f}", base_label, diff, diff_ci, note]


DEPLOY_HEADER = ["date", "revision", "cpu", "command", "preset", "flip", "config", "seeds", "labels", "wall_s",
                 "eval_accuracy", "eval_accuracy_ci95", "regret", "regret_ci95",
                 "policy_reward_mean", "policy_reward_mean_ci95", "win_rate_last", "win_rate_last_ci95",
                 "estimator_ms_per_query", "estimator_kib", "baseline", "accuracy_minus_baseline",
                 "accuracy_minus_baseline_ci95", "note"]


def seconds(stamp):
    from datetime import datetime
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").timestamp()


def deploy_rows(run, cpu, command, baseline, extra=""):
    for f in ["metrics.parquet", "meta.json", "timings.parquet", "report/sample-efficiency.csv"]:
        if not (run / f).exists():
            hint = " (run `onepass report` on it first)" if f.startswith("report/") else ""
            sys.exit(f"{run}: no {f}{hint} (a finished, reported run directory is expected)")
    meta = json.loads((run / "meta.json").read_text())
    m = pd.read_parquet(run / "metrics.parquet")
    last = m.loc[m.groupby(["label", "seed"]).step.idxmax()]
    deployed = m.groupby(["label", "seed"]).policy_reward.mean()
    t = pd.read_parquet(run / "timings.parquet").groupby("cell_id").cell_estimator_s.max()
    last = last.assign(est_s=last.cell_id.map(t))
    se = pd.read_csv(run / "report/sample-efficiency.csv")
    win = se[se.panel == "win rate against the base policy"]
    date = meta["finished"][:10]
    wall = f"{seconds(meta['finished']) - seconds(meta['started']):.0f}"
    dirty = meta.get("git_dirty") not in ("false", False)
    note = "; ".join(x for x in ["built from a tree with uncommitted changes" if dirty else "", extra] if x)
    preset = pathlib.Path(meta["spec_file"]).stem
    labels = list(dict.fromkeys(last.label))

    def base_of(label):
        if baseline in labels:
            return baseline
        strategy = label.rsplit(" / ", 1)[-1]
        return next((l for l in labels if l.startswith(baseline) and l.endswith(" / " + strategy)), "")

    for label, g in last.groupby("label", sort=False):
        n = int(g.samples_seen.max())
        acc, acc_ci = mean_ci(list(g.eval_accuracy))
        reg, reg_ci = mean_ci(list(g.regret))
        pol, pol_ci = mean_ci([deployed[(label, s)] for s in g.seed])
        w = win[win.config == label].sort_values("queries")
        wr, wr_ci = ("", "")
        if len(w):
            row = w.iloc[-1]
            wr = f"{row['mean']:.4f}"
            wr_ci = f"{(row.ci95_hi - row.ci95_lo) / 2:.4f}" if row.ci95_hi == row.ci95_hi else "1 seed"
        ms = 1000 * g.est_s.mean() / n
        kib = g.estimator_bytes.mean() / 1024
        b = base_of(label)
        if not b or b == label:
            diff, diff_ci = "", ""
        else:
            ref = last[last.label == b].set_index("seed").eval_accuracy
            diff, diff_ci = mean_ci([a - ref[s] for s, a in zip(g.seed, g.eval_accuracy) if s in ref.index])
        yield [date, meta["git_revision"][:7], cpu, command, preset, flip_of(run / "spec.resolved.toml"), label,
               len(g), n, wall, acc, acc_ci, reg, reg_ci, pol, pol_ci, wr, wr_ci, f"{ms:.3f}", f"{kib:.1f}", b,
               diff, diff_ci, note]


def main(argv):
    w = csv.writer(sys.stdout, lineterminator="\n")
    deploy = "--deploy" in argv
    argv = [a for a in argv if a != "--deploy"]
    if argv == ["--header"]:
        w.writerow(DEPLOY_HEADER if deploy else HEADER)
        return
    cpu, command, baseline, note = None, None, "omd-exact", ""
    it = iter(argv)
    for a in it:
        if a == "--note":
            note = next(it)
        elif a == "--baseline":
            baseline = next(it)
        elif a == "--cpu":
            cpu = next(it)
        elif a == "--command":
            command = next(it)
        else:
            if not cpu or not command:
                sys.exit(f"{a}: give --cpu and --command before the run directory")
            if deploy:
                table = deploy_rows(pathlib.Path(a), cpu, command, baseline, note)
            else:
                if note:
                    sys.exit("--note: only with --deploy")
                table = rows(pathlib.Path(a), cpu, command, baseline)
            for r in table:
                w.writerow(r)


if __name__ == "__main__":
    main(sys.argv[1:])
