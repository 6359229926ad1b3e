"""The benchmarks run, in their quick configuration, and their correctness checks hold.

The figures in docs/ come from these scripts; a script that no longer runs would leave
figures no command can reproduce. Each runs as its own process with its own ranks.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--d-model", "64", "--layers", "2", "--vocab", "128", "--reps", "1"]


def _run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *TINY, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def test_compare_runs_and_every_system_matches_one_process():
    out = _run("compare.py", "--seq", "16", "--batch", "2", "--steps", "1", "--warmup", "1")
    diffs = re.findall(r"loss ([0-9.e+-]+), grad norm ([0-9.e+-]+)", out)
    assert len(diffs) >= 5, out  # fsdp_fn rows, FSDP2, FSDP1, DDP
    assert all(float(a) < 1e-5 and float(b) < 1e-5 for a, b in diffs), diffs


def test_remat_bench_runs_every_row():
    out = _run("remat.py", "--seq", "16", "--batch", "2", "--steps", "1", "--warmup", "1")
    for system in ("fsdp_fn+full", "fsdp_fn+selective", "fsdp2+ac"):
        assert re.search(rf"^\s*{re.escape(system)}\s+[0-9.]+", out, re.M), out


def test_checkpoint_bench_runs():
    out = _run("checkpoint.py")
    assert "| fsdp_fn |" in out and "| fsdp2 |" in out, out
