#!/usr/bin/env python3
"""Tests of scripts/estimator_costs.py's arithmetic against a hand computation, with chunk 0 (the
evaluation before any update) as the negative control. Python 3 standard library only.

    python3 scripts/test_estimator_costs.py
"""
import pathlib
import sys
import unittest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from estimator_costs import costs  # noqa: E402


def timing(label, seed, chunk, s):
    return {"label": label, "seed": seed, "chunk": chunk, "estimator_s": s}


def metric(label, seed, t, b):
    return {"label": label, "seed": seed, "samples_seen": t, "estimator_bytes": b}


class Costs(unittest.TestCase):
    def test_by_hand(self):
        a, m = "omd-exact eta=1 / best-quantile / rloo", "mle ridge=0.3 / best-quantile / rloo"
        timings = [
            timing(a, 0, 0, 100.0), timing(a, 0, 1, 1.0), timing(a, 0, 2, 3.0),
            timing(a, 1, 0, 100.0), timing(a, 1, 1, 3.0), timing(a, 1, 2, 5.0),
            timing(m, 0, 0, 100.0), timing(m, 0, 1, 2.0), timing(m, 0, 2, 8.0),
        ]
        metrics = [metric(a, 0, 24, 10), metric(a, 0, 48, 10), metric(a, 1, 48, 10), metric(a, 1, 24, 10),
                   metric(m, 0, 48, 300), metric(m, 0, 24, 200), {"label": m, "seed": 0, "samples_seen": 0, "estimator_bytes": None}]
        got = {r[0]: r[1:] for r in costs(timings, metrics)}
        self.assertEqual(sorted(got), ["mle ridge=0.3", "omd-exact eta=1"])
        n, mean, sd, last, b0, b1 = got["omd-exact eta=1"]
        # cell means 2 and 4: mean 3, sample sd √2; last chunks 3 and 5 → 4
        self.assertEqual((n, mean, last, b0, b1), (2, 3.0, 4.0, 10, 10))
        self.assertAlmostEqual(sd, 2 ** 0.5)
        n, mean, sd, last, b0, b1 = got["mle ridge=0.3"]
        self.assertEqual((n, mean, sd, last, b0, b1), (1, 5.0, 0.0, 8.0, 200, 300))
        # negative control: chunk 0 counted as an update chunk would change the means
        shifted = [dict(r, chunk=r["chunk"] + 1) for r in timings]
        self.assertNotEqual(costs(shifted, metrics)[1][2], 3.0)


if __name__ == "__main__":
    unittest.main()
