#!/usr/bin/env python3
"""Table for `just bench-features` and `just bench-train`: median tokens/s over rounds per engine and
dtype, peak RSS, a check value (sum |phi| of the features; the loss of the training step),
and candle's ratio to PyTorch f32 and bf16. When a record carries the model's shapes (the
training step's does), each row also gives GFLOP/s and its % of the machine's peak for the row's
dtype (scripts/peak.py: the FLOPs counted from the shapes, the peak from the CPU's units and
clock; the same count for every engine, since all run the same step on the same model).

`--pass features --model PATH` (bench-features) and `--pass generate --model PATH --ids IDS`
(bench-generate: IDS is the prompts file both engines generated from) count the FLOPs of a φ
pass and of a generation run from the model file's shapes (scripts/peak.py features_flops,
generate_flops) for records that carry none.

    bench_features_report.py [--pass features|generate --model PATH [--ids IDS]] RECORD.json..."""
import json
import os
import statistics
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peak  # noqa: E402


def options(argv):
    """(--pass, --model, --ids) and the record paths from the command line."""
    opts, paths, it = {}, [], iter(argv)
    for a in it:
        if a in ("--pass", "--model", "--ids"):
            opts[a[2:]] = next(it, None)
            if opts[a[2:]] is None:
                sys.exit(f"bench_features_report: {a} needs a value")
        else:
            paths.append(a)
    if opts.get("pass") not in (None, "features", "generate"):
        sys.exit(f"bench_features_report: --pass {opts['pass']}: expected features or generate")
    if opts.get("pass") and not opts.get("model"):
        sys.exit(f"bench_features_report: --pass {opts['pass']} needs --model (the shapes come from it)")
    if opts.get("pass") == "generate" and not opts.get("ids"):
        sys.exit("bench_features_report: --pass generate needs --ids (the prompts' lengths)")
    return opts, paths


def flop_rate(opts, shaped):
    """A function from a record to its FLOP/s (None when nothing gives the FLOPs), and a line saying
    what was counted."""
    if opts.get("pass") == "features":
        shapes = peak.model_shapes(opts["model"])

        def rate(r):
            return peak.features_flops(shapes, r["batch"], r["len"])["total"] * r["tok_s"] / (r["batch"] * r["len"])
        r0 = next(iter(shaped))
        f = peak.features_flops(shapes, r0["batch"], r0["len"])
        return rate, (f"{f['total'] / 1e9:.1f} GFLOP per φ pass (linear layers {f['frozen'] / 1e9:.1f}, "
                      f"attention {f['attention'] / 1e9:.1f})")
    if opts.get("pass") == "generate":
        shapes = peak.model_shapes(opts["model"])
        spec = json.load(open(opts["ids"]))
        lens = [len(x) for x in spec["ids"]]

        def rate(r):
            # abs_sum is the generated-token count on every engine's generation record
            return peak.generate_flops(shapes, lens, spec["n"], r["abs_sum"])["total"] * r["tok_s"] / r["abs_sum"]
        return rate, (f"generation FLOPs counted per run from its generated tokens: {len(lens)} prompts "
                      f"(mean {sum(lens) / len(lens):.0f} tokens) prefilled once, x {spec['n']} samples decoded "
                      f"with a KV cache")
    r0 = next((r for r in shaped if "shapes" in r), None)
    if r0 is None:
        return None, None
    lora = r0.get("lora", {})
    f = peak.train_step_flops(r0["shapes"], r0["batch"], r0["len"], lora.get("rank", 8),
                              lora.get("targets", ("q_proj", "v_proj")))
    per_tok = f["total"] / (r0["batch"] * r0["len"])
    return (lambda r: r["tok_s"] * per_tok), (
        f"{f['total'] / 1e9:.1f} GFLOP per step (frozen {f['frozen'] / 1e9:.1f}, LM head {f['lm_head'] / 1e9:.1f}, "
        f"attention {f['attention'] / 1e9:.1f}, LoRA {f['lora'] / 1e9:.2f})")


def main(argv):
    opts, paths = options(argv)
    runs = defaultdict(list)
    for p in paths:
        r = json.load(open(p))
        dtype = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(r["dtype"], r["dtype"])
        runs[(r["engine"], dtype)].append(r)
    first = next(iter(runs.values()))[0]
    print(f"model {first['model']}, batch {first['batch']} x {first['len']} tokens, "
          f"{first['threads']} threads, {first['reps']} timed passes per round")
    rate, what = flop_rate(opts, [r for rs in runs.values() for r in rs])
    if rate:
        print(f"{what}; peak: f32 {(peak.peak('f32') or 0) / 1e9:.0f}, bf16 {(peak.peak('bf16') or 0) / 1e9:.0f} "
              f"GFLOP/s (scripts/peak.py)")
    extra = f" {'GFLOP/s':>8} {'% peak':>7}" if rate else ""
    print(f"{'engine':<8} {'dtype':<5} {'rounds':>6} {'median tok/s':>13} {'min':>8} {'max':>8} {'peak RSS MB':>12} {'check':>10}{extra}")
    med = {}
    for (eng, dt), rs in sorted(runs.items()):
        tok = [r["tok_s"] for r in rs]
        med[(eng, dt)] = statistics.median(tok)
        rss = max(r["peak_rss_mb"] or 0 for r in rs)
        extra = ""
        if rate:
            # the median over rounds of each round's rate (a generation round's FLOPs depend on
            # how many tokens it generated, so rates, not tok/s, are what is comparable)
            flops = statistics.median(rate(r) for r in rs)
            # llama.cpp runs the GGUF as quantized: its products are neither f32 nor bf16
            top = peak.peak(dt if dt in ("f32", "bf16") else "f32")
            extra = f" {flops / 1e9:>8.0f} {100 * flops / top:>6.1f}%" if top else f" {flops / 1e9:>8.0f} {'?':>7}"
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
    # onepass's bf16 over its own f32 (the bf16 target's first bar), per round as above
    b, f = runs.get(("candle", "bf16")), runs.get(("candle", "f32"))
    if b and f:
        per_round = [x["tok_s"] / y["tok_s"] for x, y in zip(b, f)]
        print(f"candle bf16 / candle f32: {med[('candle', 'bf16')] / med[('candle', 'f32')]:.2f}x"
              f" (per round {min(per_round):.2f}-{max(per_round):.2f}x)")


if __name__ == "__main__":
    main(sys.argv[1:])
