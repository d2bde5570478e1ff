#!/usr/bin/env python3
"""Tests of scripts/online_speed.py: GNU time's report parsed in both clock forms, a slice's
`time/*` scalars summed over cells and steps from TensorBoard files written here, and a round's
speedup as its first (old) run's wall time over the new run's.

    python3 scripts/test_online_speed.py

Needs tensorboard (CI installs it).
"""

import csv
import os
import pathlib
import sys
import tempfile
import unittest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import online_speed  # noqa: E402

TIME_V = """\tCommand being timed: "onepass run x.toml"
\tElapsed (wall clock) time (h:mm:ss or m:ss): {clock}
\tMaximum resident set size (kbytes): {kb}
"""


def write_time(d, name, clock, kb):
    p = os.path.join(d, name)
    with open(p, "w") as f:
        f.write(TIME_V.format(clock=clock, kb=kb))
    return p


def write_slice(d, cells):
    """cells: {cell: {tag: [values per step]}} as TensorBoard event files under d/tb/<cell>/."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    for cell, tags in cells.items():
        w = EventFileWriter(os.path.join(d, "tb", cell))
        for tag, values in tags.items():
            for step, v in enumerate(values):
                s = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=v)])
                w.add_event(event_pb2.Event(step=step, wall_time=1.0, summary=s))
        w.close()
    return d


class TimeFile(unittest.TestCase):
    def test_both_clock_forms(self):
        with tempfile.TemporaryDirectory() as d:
            self.assertEqual(online_speed.time_file(write_time(d, "a", "12:54.31", 5244252)), (774.31, 5244252 * 1024 / 1e9))
            wall, _ = online_speed.time_file(write_time(d, "b", "1:02:03", 1))
            self.assertEqual(wall, 3723.0)

    def test_a_file_without_the_clock_is_refused(self):
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "c")
            open(p, "w").write("Maximum resident set size (kbytes): 1\n")
            with self.assertRaises(SystemExit):
                online_speed.time_file(p)


class Rows(unittest.TestCase):
    def test_phases_sum_cells_and_steps_and_the_round_ratio(self):
        with tempfile.TemporaryDirectory() as d:
            old = write_slice(os.path.join(d, "old"), {
                "c0": {"time/policy_s": [10.0, 20.0], "time/generation_s": [1.0]},
                "c1": {"time/policy_s": [5.0], "policy/reward": [99.0]},
            })
            new = write_slice(os.path.join(d, "new"), {"c0": {"time/policy_s": [4.0], "time/critic_s": [2.0]}})
            ph = online_speed.phases(old)
            self.assertEqual(ph["policy_s"], 35.0)
            self.assertEqual(ph["generation_s"], 1.0)
            self.assertEqual(ph["critic_s"], 0.0)
            t_old = write_time(d, "old.err", "10:00", 1000)
            t_new = write_time(d, "new.err", "4:00", 1000)
            out = os.path.join(d, "speed.csv")
            online_speed.main(["--out", out, "--cpu", "cpu", "--command", "cmd", "--date", "2026-01-01",
                               "--run", f"1,aaaaaaa,f32,{t_old},{old}", "--run", f"1,bbbbbbb,bf16,{t_new},{new},a note, with a comma"])
            rows = list(csv.DictReader(open(out)))
            self.assertEqual([r["speedup_x"] for r in rows], ["", "2.50"])
            self.assertEqual(rows[1]["note"], "a note, with a comma")
            self.assertEqual((rows[0]["wall_time"], rows[1]["policy_s"], rows[1]["critic_s"]), ("10 min 0 s", "4", "2"))

    def test_a_slice_without_tensorboard_files_is_refused(self):
        with tempfile.TemporaryDirectory() as d:
            with self.assertRaises(SystemExit):
                online_speed.phases(d)


if __name__ == "__main__":
    unittest.main()
