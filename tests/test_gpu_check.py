"""scripts/gpu_check.py --dry-run: every step's non-CUDA part on CPU (the kernels under Triton's
interpreter, the engine judged by transformers, a hand-off between two processes over staged
shm), so the script a GPU machine runs is known to work before it gets one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.triton
def test_the_gpu_check_passes_its_dry_run(tmp_path):
    pytest.importorskip("triton")
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run", "--report", str(report)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    steps = json.loads(report.read_text())["steps"]
    assert list(steps) == ["env", "engine", "handoff", "graphs", "kernels", "speed"]
    assert all(step["result"] in ("PASS", "INFO") for step in steps.values()), steps
    assert steps["handoff"]["summary"].startswith("equal")
    assert "50/50 cases match" in steps["kernels"]["summary"]  # bench.kernels: 26, 8 narrow state, 4 verify, 12 FP8 at bf16


def test_without_a_gpu_and_without_dry_run_it_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no CUDA device visible" in done.stdout
