#!/usr/bin/env python3
"""Checks a mini run on real features (CI runs it on mini-hh-ci): the held-out accuracy of one
method at the end of the stream, mean over seeds, must reach a floor, and every degenerate pair
and cache count is reported. Usage: check_mini.py RUN_DIR [--estimator mle | --label LABEL] [--min 0.58]

The method is the run's one config of estimator kind --estimator (metrics.parquet's `estimator`
column; a label carries the hyper-parameters off the kind's defaults, e.g. "mle ridge=0.3
refit_every=25", so the kind is what stays put), or the config labelled --label."""
import argparse
import json
import pathlib
import sys

import pyarrow.parquet as pq


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--estimator", default="mle", help="the estimator kind (one config of it in the run)")
    ap.add_argument("--label", help="the config's label, instead of --estimator")
    ap.add_argument("--min", type=float, default=0.58)
    a = ap.parse_args()
    run = pathlib.Path(a.run)
    m = pq.read_table(run / "metrics.parquet").to_pydict()
    last = {}
    for i, label in enumerate(m["label"]):
        key = (label, m["seed"][i])
        if key not in last or m["step"][i] >= m["step"][last[key]]:
            last[key] = i
    by_label = {}
    for (label, _), i in last.items():
        by_label.setdefault(label, []).append((m["eval_accuracy"][i], m["eval_loss"][i], m["eval_ties"][i]))
    print(f"{'method':<32} {'seeds':>5} {'eval acc':>9} {'eval loss':>10} {'ties':>5}")
    for label, v in sorted(by_label.items()):
        acc = sum(x[0] for x in v) / len(v)
        loss = sum(x[1] for x in v) / len(v)
        print(f"{label:<32} {len(v):>5} {acc:>9.4f} {loss:>10.4f} {max(x[2] for x in v):>5}")
    data = json.loads((run / "meta.json").read_text())["data"]["dataset"]
    print("data:", json.dumps({k: data[k] for k in ("train_pairs", "eval_pairs", "degenerate_train", "degenerate_eval",
                                                     "truncated_sequences", "cache_hits", "cache_misses", "extraction_s")}))
    if a.label is not None:
        label = a.label
        if label not in by_label:
            sys.exit(f"check_mini: {run}/metrics.parquet: no config labelled {label!r} (labels: {sorted(by_label)})")
    else:
        labels = sorted({l for l, k in zip(m["label"], m["estimator"]) if k == a.estimator})
        if len(labels) != 1:
            sys.exit(f"check_mini: {run}/metrics.parquet: {len(labels)} configs of estimator kind {a.estimator!r} "
                     f"({labels}), expected one: name it with --label")
        label = labels[0]
    acc = sum(x[0] for x in by_label[label]) / len(by_label[label])
    if acc < a.min:
        sys.exit(f"check_mini: {label} reaches {acc:.4f} held-out accuracy, below the floor {a.min}")
    print(f"check_mini: {label} reaches {acc:.4f} >= {a.min}")


if __name__ == "__main__":
    main()
