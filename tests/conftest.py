"""Shared fixtures: quiet, deterministic, one thread per test process.

The suite tests the same thing on every machine: unless ``FLATZERO_TEST_GPU=1`` is set,
every GPU is hidden (``CUDA_VISIBLE_DEVICES=""``) before anything can initialize CUDA
(torch initializes it lazily, at the first query), and the ranks the tests spawn inherit
that. Without it, a GPU machine would send the "CPU" tests' buckets to CUDA. The GPU tests
(``tests/gpu``, ``tests/test_checkpoint_gpu.py``) then skip; run them with
``FLATZERO_TEST_GPU=1 python3 -m pytest -q tests/gpu tests/test_checkpoint_gpu.py``.

The suite launches rank processes a few hundred times (``flatzero.launch.run_ranks``):
they fork from one server that imported torch and flatzero once
(``preload_rank_processes``), instead of each starting an interpreter and importing torch
(~3 CPU-seconds a rank, most of the suite's time on 2 cores). What a rank sees is the same
as under ``spawn``; ``tests/test_launch.py`` runs both. The server also imports what a
rank imports anyway at its first optimizer: ``torch._dynamo`` (torch imports it at the
first ``torch.optim.Optimizer`` of a process: ``add_param_group`` is wrapped in
``torch._disable_dynamo``; ~1 CPU-second) and the flatzero packages a ``ZeroOptimizer``
loads (optim, checkpoint, the door's engine), which every rank paid again.
"""

from __future__ import annotations

import os

GPU_ENV = "FLATZERO_TEST_GPU"
"""Set to ``1`` to let the tests see the machine's GPUs."""

if os.environ.get(GPU_ENV) != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import subprocess  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from flatzero.launch import preload_rank_processes  # noqa: E402

RANK_PRELOAD = (
    "torch",
    "torch._dynamo",
    "flatzero",
    "flatzero.optim",
    "flatzero.checkpoint",
    "flatzero.deepspeed.engine",
    "pytest",
)
"""What the rank server imports before it forks a rank (see the module docstring)."""

preload_rank_processes(RANK_PRELOAD)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


RENDEZVOUS_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
)
"""What ``flatzero.initialize`` sets in the process for a world-of-one group."""


@pytest.fixture(autouse=True)
def _no_process_group_left() -> Iterator[None]:
    """``flatzero.initialize`` in the test process makes a world-of-one default group and,
    as ``deepspeed.initialize`` does, leaves it: a test that made one takes it down, so the
    tests after it start without one (a group a module fixture made is left alone). The
    rendezvous variables it set go too: a later test's subprocess would inherit
    ``MASTER_PORT``, a port this process's store may still hold (EADDRINUSE)."""
    had_one = dist.is_initialized()
    env = {name: os.environ.get(name) for name in RENDEZVOUS_ENV}
    yield
    if not had_one and dist.is_initialized():
        dist.destroy_process_group()
    if not had_one:
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 4 MiB tmpfs at ``tmp_path / "disk"`` (unmounted after the test); skipped where
    this process may not mount one (not root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (a tmpfs mount)")
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)
