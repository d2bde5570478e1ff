#!/usr/bin/env python3
"""bench-online's table: the median time split of one online chunk in onepass and TRL over the
rounds, and TRL / onepass per round (median and range). Usage: bench_online_report.py JSON…"""
import json
import statistics
import sys

rows = [json.loads(open(p).read()) for p in sys.argv[1:] if open(p).read().strip()]
for r in rows:
    r.setdefault("dtype", "f32")


def med(side, key):
    if key is None:
        return None
    return statistics.median(r[key] for r in side)


def cell(v):
    return f"{v:9.2f}" if v is not None else f"{'—':>9}"


parts = [
    ("generation (chunk's samples)", "generation_s", "generation_s"),
    ("φ + learned reward", "phi_s", "phi_s"),
    ("estimator (θ's update)", "estimator_s", None),
    ("policy update (scoring + steps)", "policy_s", None),
    ("  TRL: old + reference log-probs", None, "score_s"),
    ("  TRL: gradient steps", None, "update_s"),
    ("evaluation: generation", "eval_generation_s", "eval_generation_s"),
    ("evaluation: φ + reward", "eval_phi_s", "eval_phi_s"),
    ("evaluation: scoring", "eval_score_s", "eval_score_s"),
    ("chunk", "chunk_s", "chunk_s"),
]
compared = 0
for dtype in ("f32", "bf16"):
    one = [r for r in rows if r["engine"] == "onepass" and r["dtype"] == dtype]
    trl = [r for r in rows if r["engine"] == "trl" and r["dtype"] == dtype]
    if not one or not trl:
        continue
    compared += 1
    print(f"{dtype}: threads {one[0]['threads']}; {len(one)} rounds; medians in seconds; "
          f"TRL {trl[0].get('trl', '?')}, torch {trl[0].get('torch', '?')}")
    print(f"{'part':<34} {'onepass':>9} {'TRL':>9}")
    for name, ok, tk in parts:
        print(f"{name:<34} {cell(med(one, ok))} {cell(med(trl, tk))}")
    ratios = [t["chunk_s"] / o["chunk_s"] for o, t in zip(one, trl)]
    print(f"{dtype}: TRL / onepass per chunk: {statistics.median(ratios):.2f}x median (rounds {min(ratios):.2f}–{max(ratios):.2f}x)\n")
if not compared:
    sys.exit(f"bench-online: no dtype with both onepass and TRL rounds finished ({len(rows)} results): nothing to compare")
