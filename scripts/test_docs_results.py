#!/usr/bin/env python3
"""Tests of scripts/docs_results.py: the committed fragments are current, and the check fails.

    python3 scripts/test_docs_results.py

Each failing case runs on a copy of docs/results and docs/src/results in a temporary directory
(`--root`), so the tree is never touched. Python 3 standard library only.
"""

import csv
import pathlib
import shutil
import subprocess
import sys
import tempfile
import unittest

REPO = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "docs_results.py"


def run(*args):
    p = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


class DocsResults(unittest.TestCase):
    def setUp(self):
        self.tmp = pathlib.Path(tempfile.mkdtemp())
        shutil.copytree(REPO / "docs" / "results", self.tmp / "docs" / "results")
        shutil.copytree(REPO / "docs" / "src" / "results", self.tmp / "docs" / "src" / "results")

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def check(self):
        return run("--root", str(self.tmp), "--check")

    def test_the_committed_fragments_are_current(self):
        rc, out = run("--check")
        self.assertEqual(rc, 0, out)
        rc, out = self.check()
        self.assertEqual(rc, 0, out)

    def test_a_readme_table_is_rendered_from_its_summary(self):
        shutil.copy(REPO / "README.md", self.tmp / "README.md")
        rc, out = self.check()
        self.assertEqual(rc, 0, out)
        readme = self.tmp / "README.md"
        text = readme.read_text(encoding="utf-8")
        # the row a quoted `where` value (with spaces) selects, with the summary's number
        want = "rloo (learned reward) − rloo (null reward)"
        with open(self.tmp / "docs" / "results" / "online-proof-8.csv", encoding="utf-8") as f:
            row = next(r for r in csv.DictReader(f) if r["comparison"] == want)
        line = f"| {want} | {row['difference']} |"
        self.assertIn(line, text)
        self.assertNotIn("| rloo (learned reward) − rloo (oracle reward) |", text, "a row the block does not select")
        # a number typed into the block by hand is caught, and rendering puts the summary's back
        readme.write_text(text.replace(line, f"| {want} | +9.999 |", 1), encoding="utf-8")
        rc, out = self.check()
        self.assertEqual(rc, 1, out)
        self.assertIn("README.md", out)
        rc, out = run("--root", str(self.tmp))
        self.assertEqual(rc, 0, out)
        self.assertEqual(readme.read_text(encoding="utf-8"), text)
        # a block naming a column the summary lacks is one line naming it
        readme.write_text(text.replace("columns=comparison,", "columns=comparisons,", 1), encoding="utf-8")
        rc, out = self.check()
        self.assertEqual(rc, 2, out)
        self.assertIn("column `comparisons`", out)
        # an unclosed quote is one line naming the block
        readme.write_text(text.replace('best-of-n − base" -->', 'best-of-n − base -->', 1), encoding="utf-8")
        rc, out = self.check()
        self.assertEqual(rc, 2, out)
        self.assertIn("expected key=value words", out)

    def test_an_edited_value_makes_the_check_fail_naming_the_fragment(self):
        csv = self.tmp / "docs" / "results" / "online-proof.csv"
        text = csv.read_text(encoding="utf-8")
        lines = text.splitlines(keepends=True)
        # change the last character of the first data row's first measured value
        header = lines[0].rstrip("\n").split(",")
        self.assertEqual(header[:4], ["date", "revision", "cpu", "command"])
        row = lines[1]
        edited = row.replace("+0.117", "+0.118", 1)
        self.assertNotEqual(edited, row, "the row under test lost its value")
        csv.write_text("".join([lines[0], edited, *lines[2:]]), encoding="utf-8")
        rc, out = self.check()
        self.assertEqual(rc, 1, out)
        self.assertIn("docs/src/results/online-proof.md", out)
        # rendering again makes it current
        rc, out = run("--root", str(self.tmp))
        self.assertEqual(rc, 0, out)
        rc, out = self.check()
        self.assertEqual(rc, 0, out)
        self.assertIn("+0.118", (self.tmp / "docs" / "src" / "results" / "online-proof.md").read_text())

    def test_a_hand_edited_or_orphaned_fragment_fails(self):
        frag = self.tmp / "docs" / "src" / "results" / "bench.md"
        frag.write_text(frag.read_text() + "a line typed by hand\n")
        (self.tmp / "docs" / "src" / "results" / "orphan.md").write_text("x\n")
        rc, out = self.check()
        self.assertEqual(rc, 1, out)
        self.assertIn("docs/src/results/bench.md", out)
        self.assertIn("docs/src/results/orphan.md", out)

    def test_bad_input_is_one_line_naming_file_row_and_column(self):
        csv = self.tmp / "docs" / "results" / "bench.csv"
        lines = csv.read_text(encoding="utf-8").splitlines(keepends=True)
        cases = [
            (lines[1].replace("2026-", "26-", 1), "row 2: column `date`"),
            (lines[1].replace(lines[1].split(",")[1], "HEAD", 1), "row 2: column `revision`"),
            ("2026-11-28,abc1234\n", "row 2: 2 fields"),
        ]
        for bad, expected in cases:
            csv.write_text("".join([lines[0], bad, *lines[2:]]), encoding="utf-8")
            rc, out = self.check()
            self.assertEqual(rc, 2, out)
            self.assertEqual(len(out.strip().splitlines()), 1, out)
            self.assertIn("docs/results/bench.csv", out)
            self.assertIn(expected, out)
        csv.write_text("date,revision,cpu,tok_s\n2026-11-28,abc1234,x,1\n", encoding="utf-8")
        rc, out = self.check()
        self.assertEqual(rc, 2, out)
        self.assertIn("row 1 (header)", out)


if __name__ == "__main__":
    unittest.main()
