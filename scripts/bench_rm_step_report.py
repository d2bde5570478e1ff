#!/usr/bin/env python3
"""Table for `just bench-rm-step`: median seconds per step over rounds per engine and rule, HVPs
per step, peak RSS, the loss (a check that both computed the same thing), and PyTorch's time over
onepass's (> 1: onepass is faster), with its per-round range.

With `--model PATH` each row also gives GFLOP/s and its % of the machine's f32 peak
(scripts/peak.py rm_step_flops: one gradient pass counted from the model's shapes — LoRA r 8 on
every linear layer, as both engines run it — plus the step's HVPs at the gradient passes each
costs by how it is formed: onepass's omd by central differences 2, omd-forward 1, omd-exact (the
R-operator) 1, omd-gn 1.5; PyTorch's double backward 1).

    bench_rm_step_report.py [--model PATH] RECORD.json..."""
import json
import os
import statistics
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peak  # noqa: E402

# How each engine's rule forms its Hessian-vector products (scripts/peak.py HVP_PASSES)
HVP_KIND = {("candle", "omd"): "central", ("candle", "omd-forward"): "forward", ("candle", "omd-exact"): "exact",
            ("candle", "omd-gn"): "gauss-newton", ("torch", "omd"): "exact"}


def main(argv):
    model = None
    if argv[:1] == ["--model"]:
        if len(argv) < 2:
            sys.exit("bench_rm_step_report: --model needs a value")
        model, argv = argv[1], argv[2:]
    shapes = peak.model_shapes(model) if model else None
    top = peak.peak("f32")
    paths = argv
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
    if shapes:
        g = peak.rm_step_flops(shapes, first["pairs"], first["len"])["grad_pass"]
        print(f"{g / 1e9:.1f} GFLOP per gradient pass (scripts/peak.py); f32 peak {(top or 0) / 1e9:.0f} GFLOP/s")
    extra = f" {'GFLOP/s':>8} {'% peak':>7}" if shapes else ""
    print(f"{'engine':<7} {'rule':<11} {'rounds':>6} {'median s/step':>14} {'min':>7} {'max':>7} {'HVPs':>5} {'peak RSS MB':>12} {'loss':>8}{extra}")
    med = {}
    for (eng, rule), rs in sorted(runs.items()):
        s = [statistics.median(r["step_s"]) for r in rs]
        med[(eng, rule)] = statistics.median(s)
        rss = max(r["peak_rss_mb"] or 0 for r in rs)
        extra = ""
        if shapes:
            r0 = rs[-1]
            kind = HVP_KIND.get((eng, rule))
            if r0["hvps"] and kind is None:
                sys.exit(f"bench_rm_step_report: {eng} {rule}: its HVPs have no cost in HVP_KIND (expected one of "
                         f"{sorted(HVP_KIND)})")
            f = peak.rm_step_flops(shapes, r0["pairs"], r0["len"], r0["hvps"], kind or "exact")
            rate = f["total"] / med[(eng, rule)]
            extra = f" {rate / 1e9:>8.0f} {100 * rate / top:>6.1f}%" if top else f" {rate / 1e9:>8.0f} {'?':>7}"
        print(f"{eng:<7} {rule:<11} {len(rs):>6} {med[(eng, rule)]:>14.2f} {min(s):>7.2f} {max(s):>7.2f} {rs[-1]['hvps']:>5} {rss:>12.0f} {rs[-1]['loss']:>8.4f}{extra}")
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
