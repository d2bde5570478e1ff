#!/usr/bin/env python3
"""Table for `just bench-features` and `just bench-train`: median tokens/s over rounds per engine and
dtype, peak RSS, a check value (sum |phi| of the features; the loss of the training step),
and candle's ratio to PyTorch f32 and bf16. When a record carries the model's shapes (the
training step's does), each row also gives GFLOP/s and its % of the machine's peak for the row's
dtype (scripts/peak.py: the FLOPs counted from the shapes, the peak from the CPU's units and
clock; the same count for every engine, since all run the same step on the same model)."""
import json
import os
import statistics
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peak  # noqa: E402


def main(paths):
    runs = defaultdict(list)
    for p in paths:
        r = json.load(open(p))
        dtype = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(r["dtype"], r["dtype"])
        runs[(r["engine"], dtype)].append(r)
    first = next(iter(runs.values()))[0]
    print(f"model {first['model']}, batch {first['batch']} x {first['len']} tokens, "
          f"{first['threads']} threads, {first['reps']} timed passes per round")
    shaped = next((r for rs in runs.values() for r in rs if "shapes" in r), None)
    flops_per_tok = None
    if shaped:
        lora = shaped.get("lora", {})
        f = peak.train_step_flops(shaped["shapes"], shaped["batch"], shaped["len"], lora.get("rank", 8),
                                  lora.get("targets", ("q_proj", "v_proj")))
        flops_per_tok = f["total"] / (shaped["batch"] * shaped["len"])
        print(f"{f['total'] / 1e9:.1f} GFLOP per step (frozen {f['frozen'] / 1e9:.1f}, LM head {f['lm_head'] / 1e9:.1f}, "
              f"attention {f['attention'] / 1e9:.1f}, LoRA {f['lora'] / 1e9:.2f}); peak: f32 "
              f"{(peak.peak('f32') or 0) / 1e9:.0f}, bf16 {(peak.peak('bf16') or 0) / 1e9:.0f} GFLOP/s (scripts/peak.py)")
    extra = f" {'GFLOP/s':>8} {'% peak':>7}" if flops_per_tok else ""
    print(f"{'engine':<8} {'dtype':<5} {'rounds':>6} {'median tok/s':>13} {'min':>8} {'max':>8} {'peak RSS MB':>12} {'check':>10}{extra}")
    med = {}
    for (eng, dt), rs in sorted(runs.items()):
        tok = [r["tok_s"] for r in rs]
        med[(eng, dt)] = statistics.median(tok)
        rss = max(r["peak_rss_mb"] or 0 for r in rs)
        extra = ""
        if flops_per_tok:
            rate = med[(eng, dt)] * flops_per_tok
            top = peak.peak(dt if dt in ("f32", "bf16") else "f32")
            extra = f" {rate / 1e9:>8.0f} {100 * rate / top:>6.1f}%" if top else f" {rate / 1e9:>8.0f} {'?':>7}"
        print(f"{eng:<8} {dt:<5} {len(rs):>6} {med[(eng, dt)]:>13.0f} {min(tok):>8.0f} {max(tok):>8.0f} {rss:>12.0f} {rs[-1]['abs_sum']:>10.2f}{extra}")
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
