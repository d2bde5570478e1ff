#!/usr/bin/env python3
"""Where the time goes in a Chrome trace written by `onepass features bench --trace`:
inclusive and self time per span name, as a share of the traced wall time."""
import json
import sys
from collections import defaultdict


def main(path):
    events = [e for e in json.load(open(path)) if e.get("ph") in ("B", "E")]
    incl, selft, count = defaultdict(float), defaultdict(float), defaultdict(int)
    stacks = defaultdict(list)  # tid -> [(name, start, child_time)]
    lo, hi = float("inf"), 0.0
    for e in events:
        st = stacks[e["tid"]]
        if e["ph"] == "B":
            st.append([e["name"], e["ts"], 0.0])
            lo = min(lo, e["ts"])
        else:
            name, t0, child = st.pop()
            d = e["ts"] - t0
            hi = max(hi, e["ts"])
            incl[name] += d
            selft[name] += d - child
            count[name] += 1
            if st:
                st[-1][2] += d
    wall = hi - lo
    print(f"traced wall time {wall / 1e6:.3f} s")
    print(f"{'span':<12} {'count':>6} {'incl s':>8} {'self s':>8} {'self %':>7}")
    for name in sorted(selft, key=lambda n: -selft[n]):
        print(f"{name:<12} {count[name]:>6} {incl[name] / 1e6:>8.3f} {selft[name] / 1e6:>8.3f} {100 * selft[name] / wall:>6.1f}%")


if __name__ == "__main__":
    main(sys.argv[1])
