#!/usr/bin/env python3
"""Table for `just bench-rm-step`: median seconds per step over rounds per engine and rule, HVPs
per step, peak RSS, the loss (a check that both computed the same thing), and PyTorch's time over
onepass's (> 1: onepass is faster), with its per-round range."""
import json
import statistics
import sys
from collections import defaultdict


def main(paths):
    runs = defaultdict(list)
    failed = []
    for p in paths:
        r = json.load(open(p))
        if "failed" in r:
            failed.append(r)
            continue
        runs[(r["engine"], r["rule"])].append(r)
    first = next(iter(runs.values()))[0]
    print(f"model {first['model']}, {first['pairs']} pairs x 2 x {first['len']} tokens, "
          f"{first['threads']} threads, {first['reps']} timed steps per round")
    print(f"{'engine':<7} {'rule':<11} {'rounds':>6} {'median s/step':>14} {'min':>7} {'max':>7} {'HVPs':>5} {'peak RSS MB':>12} {'loss':>8}")
    med = {}
    for (eng, rule), rs in sorted(runs.items()):
        s = [statistics.median(r["step_s"]) for r in rs]
        med[(eng, rule)] = statistics.median(s)
        rss = max(r["peak_rss_mb"] or 0 for r in rs)
        print(f"{eng:<7} {rule:<11} {len(rs):>6} {med[(eng, rule)]:>14.2f} {min(s):>7.2f} {max(s):>7.2f} {rs[-1]['hvps']:>5} {rss:>12.0f} {rs[-1]['loss']:>8.4f}")
    for r in failed:
        print(f"{r['engine']} {r['rule']}: failed in a round ({r['failed'] or 'killed: out of memory?'})")
    for rule, peer in (("sgd", "sgd"), ("omd", "omd"), ("omd-exact", "omd"), ("omd-forward", "omd"), ("omd-gn", "omd")):
        c, t = runs.get(("candle", rule)), runs.get(("torch", peer))
        if not (c and t):
            continue
        per_round = [statistics.median(b["step_s"]) / statistics.median(a["step_s"]) for a, b in zip(c, t)]
        print(f"{rule}: torch {peer} / candle time {med[('torch', peer)] / med[('candle', rule)]:.2f}x"
              f" (per round {min(per_round):.2f}-{max(per_round):.2f}x; > 1: onepass faster)"
              + ("; the Gauss-Newton matrix, not the Hessian: another step" if rule == "omd-gn" else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
