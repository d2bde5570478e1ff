"""What the per-setting notebooks share: finding a run, checking it is a finished run of the
notebook's setting, loading its tables, and the subtitle of a figure's bands.

The notebooks import it from beside them (`python3 notebooks/passive.py RUN_DIR`, or Jupyter
started in notebooks/); copy it along with a notebook you take elsewhere."""
import json
import os
import pathlib
import sys

import pandas as pd


def over(seeds):
    """The figure's subtitle for its bands."""
    return f"mean ± 1 std over {seeds} seeds" if seeds > 1 else "one seed (no band)"


def find_run(setting):
    """The run directory: the first argument, else $ONEPASS_RUN, else the newest run of `setting`
    under results/ (a Jupyter kernel's own arguments are not a run)."""
    args = [] if "ipykernel" in sys.modules else [a for a in sys.argv[1:] if not a.startswith("-")]
    if args or os.environ.get("ONEPASS_RUN"):
        return pathlib.Path(args[0] if args else os.environ["ONEPASS_RUN"])
    runs = [
        m.parent
        for root in (pathlib.Path("results"), pathlib.Path("../results"))
        for m in root.glob("*/meta.json")
        if json.loads(m.read_text()).get("setting") == setting
    ]
    assert runs, f"no {setting} run under results/: pass a run directory (python3 notebooks/{setting}.py RUN_DIR) or set ONEPASS_RUN"
    return max(runs, key=lambda p: p.stat().st_mtime)


def check_run(run, setting, tables=("metrics.parquet", "cells.parquet")):
    """Fails, naming the file, unless `run` is a finished run of `setting` with `tables`."""
    meta_path = run / "meta.json"
    assert meta_path.is_file(), f"{meta_path}: not found: {run} is not a finished onepass run directory"
    meta = json.loads(meta_path.read_text())
    assert meta.get("setting") == setting, (
        f"{meta_path}: setting = {meta.get('setting')!r}, this notebook draws {setting!r} runs "
        f"(use notebooks/{meta.get('setting')}.py)"
    )
    for name in tables:
        assert (run / name).is_file(), f"{run / name}: not found in a {setting} run"
    return meta


def load(setting, tables=("metrics.parquet", "cells.parquet")):
    """(run directory, meta.json, metrics, cells) of the run `find_run` names, checked by
    `check_run`; the metrics' rows all of `setting`."""
    run = find_run(setting)
    meta = check_run(run, setting, tables)
    metrics = pd.read_parquet(run / "metrics.parquet")
    cells = pd.read_parquet(run / "cells.parquet")
    assert (metrics["setting"] == setting).all(), f"{run / 'metrics.parquet'}: rows of another setting than {setting!r}"
    return run, meta, metrics, cells
