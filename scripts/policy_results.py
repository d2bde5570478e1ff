#!/usr/bin/env python3
"""Rows of a committed results summary (docs/results/*.csv) from a run's policy comparisons.

    python3 scripts/policy_results.py RUN --command "just reproduce-deploy online-proof" \
        [--wall "3 h 20 min"] [--out docs/results/online-proof-8.csv]

Reads RUN/report/policy_comparisons.csv, which `onepass report RUN` writes (every number is
the report's: this script computes nothing), and RUN/meta.json (the revision and the date the
run finished), and writes one row per comparison with the date, revision, CPU and command the
book's tables need. The CPU is read from /proc/cpuinfo (model name, cores, vector extensions)
unless --cpu names it: run it on the machine that made the run, or pass --cpu.
"""
import argparse
import csv
import json
import os
import sys


def cpu_name():
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return None
    model = next((l.split(":", 1)[1].strip() for l in text.splitlines() if l.startswith("model name")), None)
    flags = next((l.split(":", 1)[1].split() for l in text.splitlines() if l.startswith("flags")), [])
    if model is None:
        return None
    cores = os.cpu_count()
    ext = "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "no AVX2")
    if "avx512_bf16" in flags:
        ext += " BF16"
    if "amx_tile" in flags:
        ext += ", AMX"
    return f"{cores}-core {model} ({ext})"


def fmt(v, signed=False):
    if v == "":
        return ""
    x = float(v)
    s = f"{x:+.3f}" if signed else f"{x:.3f}"
    return s.replace("-", "−")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run")
    ap.add_argument("--command", required=True, help="the command that made the run, as the book shows it")
    ap.add_argument("--cpu", help="the machine, when this is not the one that made the run")
    ap.add_argument("--wall", default="", help="the run's wall time, as measured")
    ap.add_argument("--out", help="append to this CSV (written with its header when new); else print")
    ap.add_argument("--tree-of", metavar="REV",
                    help="the run's build had uncommitted changes that were then committed as REV, a child of "
                         "the revision meta.json names: the rows name REV (checked with git: REV's parent must be "
                         "meta.json's revision)")
    a = ap.parse_args()
    comp = os.path.join(a.run, "report", "policy_comparisons.csv")
    if not os.path.exists(comp):
        sys.exit(f"policy_results: {comp}: not found; run `onepass report {a.run}` first")
    try:
        meta = json.load(open(os.path.join(a.run, "meta.json")))
    except (OSError, ValueError) as e:
        sys.exit(f"policy_results: {a.run}/meta.json: {e}")
    rev = meta["git_revision"][:7]
    if meta.get("git_dirty") not in ("false", False):
        if not a.tree_of:
            sys.exit(f"policy_results: {a.run}: made by a build with uncommitted changes (git_dirty = {meta.get('git_dirty')}): a summary needs a committed revision (or --tree-of REV)")
        import subprocess
        parent = subprocess.run(["git", "rev-parse", f"{a.tree_of}^"], capture_output=True, text=True).stdout.strip()
        if not parent.startswith(meta["git_revision"][:7]):
            sys.exit(f"policy_results: --tree-of {a.tree_of}: its parent is {parent[:7] or 'unknown'}, the run's build was of {rev}")
        rev = a.tree_of[:7]
    elif a.tree_of:
        sys.exit(f"policy_results: --tree-of {a.tree_of}: the run's build was clean ({rev}): leave it out")
    cpu = a.cpu or cpu_name()
    if not cpu:
        sys.exit("policy_results: the CPU is unknown: pass --cpu")
    date = meta["finished"][:10]
    header = ["date", "revision", "cpu", "command", "wall_time", "shared", "comparison", "seeds", "base", "last",
              "difference", "ci95", "p", "detectable_80", "prompts", "boot95"]
    rows = []
    for r in csv.DictReader(open(comp)):
        against = r["against"]
        what = f"{r['arm']} − base" if against == "base" else f"{r['arm']} − {against}"
        ci = f"[{fmt(r['ci95_lo'], True)}, {fmt(r['ci95_hi'], True)}]" if r["ci95_lo"] else "1 seed: no interval"
        boot = f"[{fmt(r['boot95_lo'], True)}, {fmt(r['boot95_hi'], True)}]" if r["boot95_lo"] else ""
        rows.append([date, rev, cpu, a.command, a.wall, r["group"], what, r["seeds"], fmt(r["base"]), fmt(r["last"]),
                     fmt(r["mean"], True), ci, fmt(r["p"]), fmt(r["detectable_80"]), r["prompts"], boot])
    if a.out:
        new = not os.path.exists(a.out)
        with open(a.out, "a", newline="") as f:
            w = csv.writer(f, lineterminator="\n")
            if new:
                w.writerow(header)
            w.writerows(rows)
        print(f"policy_results: {len(rows)} rows → {a.out}")
    else:
        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(header)
        w.writerows(rows)


if __name__ == "__main__":
    main()
