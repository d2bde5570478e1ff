#!/usr/bin/env python3
"""Table for `just bench-features` and `just bench-train`: median tokens/s over rounds per engine and
dtype, peak RSS, a check value (sum |phi| of the features; the loss of the training step),
and candle's ratio to PyTorch f32 and bf16."""
import json
import statistics
import sys
from collections import defaultdict


def main(paths):
    runs = defaultdict(list)
    for p in paths:
        r = json.load(open(p))
        dtype = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(r["dtype"], r["dtype"])
        runs[(r["engine"], dtype)].append(r)
    first = next(iter(runs.values()))[0]
    print(f"model {first['model']}, batch {first['batch']} x {first['len']} tokens, "
          f"{first['threads']} threads, {first['reps']} timed passes per round")
    print(f"{'engine':<8} {'dtype':<5} {'rounds':>6} {'median tok/s':>13} {'min':>8} {'max':>8} {'peak RSS MB':>12} {'check':>10}")
    med = {}
    for (eng, dt), rs in sorted(runs.items()):
        tok = [r["tok_s"] for r in rs]
        med[(eng, dt)] = statistics.median(tok)
        rss = max(r["peak_rss_mb"] or 0 for r in rs)
        print(f"{eng:<8} {dt:<5} {len(rs):>6} {med[(eng, dt)]:>13.0f} {min(tok):>8.0f} {max(tok):>8.0f} {rss:>12.0f} {rs[-1]['abs_sum']:>10.2f}")
    # Ratios per round too (engines alternate within a round, so a round's ratio compares runs
    # that saw the same machine): the min-max says how much of the median is noise.
    peers = sorted(k for k in runs if k[0] != "candle")
    for cd in ("f32", "bf16"):
        for peer in peers:
            c, t = runs.get(("candle", cd)), runs[peer]
            if not c:
                continue
            per_round = [a["tok_s"] / b["tok_s"] for a, b in zip(c, t)]
            print(f"candle {cd} / {peer[0]} {peer[1]}: {med[('candle', cd)] / med[peer]:.2f}x"
                  f" (per round {min(per_round):.2f}-{max(per_round):.2f}x)")


if __name__ == "__main__":
    main(sys.argv[1:])
