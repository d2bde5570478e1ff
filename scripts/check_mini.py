#!/usr/bin/env python3
"""Checks a mini run on real features (CI runs it on mini-hh-ci): the held-out accuracy of one
method at the end of the stream, mean over seeds, must reach a floor, and every degenerate pair
and cache count is reported. Usage: check_mini.py RUN_DIR [--label mle] [--min 0.58]"""
import argparse
import json
import pathlib
import sys

import pyarrow.parquet as pq


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--label", default="mle")
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
    print(f"{'method':<24} {'seeds':>5} {'eval acc':>9} {'eval loss':>10} {'ties':>5}")
    for label, v in sorted(by_label.items()):
        acc = sum(x[0] for x in v) / len(v)
        loss = sum(x[1] for x in v) / len(v)
        print(f"{label:<24} {len(v):>5} {acc:>9.4f} {loss:>10.4f} {max(x[2] for x in v):>5}")
    data = json.loads((run / "meta.json").read_text())["data"]["dataset"]
    print("data:", json.dumps({k: data[k] for k in ("train_pairs", "eval_pairs", "degenerate_train", "degenerate_eval",
                                                     "truncated_sequences", "cache_hits", "cache_misses", "extraction_s")}))
    if a.label not in by_label:
        sys.exit(f"check_mini: no method labelled {a.label!r} in {run}")
    acc = sum(x[0] for x in by_label[a.label]) / len(by_label[a.label])
    if acc < a.min:
        sys.exit(f"check_mini: {a.label} reaches {acc:.4f} held-out accuracy, below the floor {a.min}")
    print(f"check_mini: {a.label} reaches {acc:.4f} >= {a.min}")


if __name__ == "__main__":
    main()
