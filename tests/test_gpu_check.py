"""``scripts/gpu_check.sh``, the one call to make on a lent GPU: its CPU-runnable parts run
here, and its CUDA parts skip cleanly (the suite hides any GPU: ``tests/conftest.py``)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CUDA_STEPS = ("tests_gpu", "sanitizer", "bench_device_memory", "bench_init", "bench_step")


def test_the_gpu_check_runs_its_host_parts_and_skips_the_cuda_ones(tmp_path):
    assert not torch.cuda.is_available()
    out = tmp_path / "check"
    done = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh")],
        env={**os.environ, "OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split()[0] for line in summary] == ["env", "probes", *CUDA_STEPS]
    assert summary[0].startswith("env rc=0") and summary[1].startswith("probes rc=0")
    assert all(line.endswith("skipped (no CUDA)") for line in summary[2:])
    assert "torch" in (out / "env.log").read_text()
    probes = {p.stem: json.loads(p.read_text()) for p in (out / "probes").glob("*.json")}
    names = ("latched_error", "fork_pinned", "snapshot_registered")
    assert probes == {name: {"skipped": "no CUDA"} for name in names}


def test_the_gpu_check_keeps_within_its_overall_deadline(tmp_path):
    """Review of issue 41, finding 11: the steps' own limits add up to more than a device
    call may run (600 s); once ``GPU_CHECK_SECONDS`` is spent, later steps are skipped and
    the summary still comes back."""
    out = tmp_path / "check"
    done = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh")],
        env={**os.environ, "OUT": str(out), "GPU_CHECK_SECONDS": "5"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[:2] == ["env skipped (time spent)", "probes skipped (time spent)"]
