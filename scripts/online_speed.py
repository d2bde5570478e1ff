#!/usr/bin/env python3
"""Rows of docs/results/online-proof-speed.csv: one slice of a preset run by two builds in
alternating rounds (old, new, old, new, …), each row one run's wall time and peak RSS (from
`/usr/bin/time -v`) and where its time went (the `time/*` scalars its cells wrote to
TensorBoard — policy_timings.parquet's columns — summed over the slice's cells and chunks).

    python3 scripts/online_speed.py --out docs/results/online-proof-speed.csv \
        --cpu "2-core Intel Xeon (AVX-512 BF16, AMX)" --command "…" \
        --run ROUND,REVISION,DTYPE,TIME_FILE,SLICE_DIR[,NOTE] [--run …]

ROUND pairs an old run with the new run after it (old rows carry no ratio; a new row's
`speedup_x` is its round's old wall time over its own). Every number is read from the files;
the script types none.
"""
import argparse
import csv
import datetime
import glob
import os
import re
import sys


PHASES = ["generation_s", "phi_s", "policy_s", "critic_s", "eval_s"]


def time_file(path):
    """(wall seconds, peak RSS in GB) from GNU time's -v report."""
    text = open(path).read()
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", text)
    r = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    if m is None or r is None:
        sys.exit(f"online_speed: {path}: no wall clock time or maximum resident set size (expected /usr/bin/time -v output)")
    wall = int(m.group(1) or 0) * 3600 + int(m.group(2)) * 60 + float(m.group(3))
    return wall, int(r.group(1)) * 1024 / 1e9


def phases(slice_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cells = sorted(glob.glob(os.path.join(slice_dir, "tb", "*")))
    if not cells:
        sys.exit(f"online_speed: {slice_dir}/tb: no cells' TensorBoard files")
    out = {p: 0.0 for p in PHASES}
    for d in cells:
        ea = EventAccumulator(d, size_guidance={"scalars": 0})
        ea.Reload()
        tags = set(ea.Tags()["scalars"])
        for p in PHASES:
            if f"time/{p}" in tags:
                out[p] += sum(e.value for e in ea.Scalars(f"time/{p}"))
    return out


def mmss(s):
    return f"{int(s // 60)} min {int(round(s % 60))} s"


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--note", default="")
    ap.add_argument("--run", action="append", required=True)
    a = ap.parse_args(argv)
    runs = []
    for spec in a.run:
        parts = spec.split(",", 5)
        if len(parts) < 5:
            sys.exit(f"online_speed: --run {spec!r}: expected ROUND,REVISION,DTYPE,TIME_FILE,SLICE_DIR[,NOTE]")
        rnd, rev, dtype, tf, slice_dir = parts[:5]
        note = parts[5] if len(parts) == 6 else a.note
        wall, rss = time_file(tf)
        runs.append((rnd, rev, dtype, wall, rss, phases(slice_dir), note))
    old = {}
    for rnd, rev, dtype, wall, *_ in runs:
        old.setdefault(rnd, (rev, wall))
    header = ["date", "revision", "cpu", "command", "round", "dtype", "wall_time", "wall_s", "peak_rss_gb"]
    header += PHASES + ["speedup_x", "note"]
    rows = []
    for rnd, rev, dtype, wall, rss, ph, note in runs:
        first_rev, first_wall = old[rnd]
        speed = "" if rev == first_rev else f"{first_wall / wall:.2f}"
        rows.append([a.date, rev, a.cpu, a.command, rnd, dtype, mmss(wall), f"{wall:.0f}", f"{rss:.2f}"]
                    + [f"{ph[p]:.0f}" for p in PHASES] + [speed, note])
    new = not os.path.exists(a.out)
    with open(a.out, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(header)
        w.writerows(rows)
    print(f"online_speed: {len(rows)} rows → {a.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
