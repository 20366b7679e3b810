"""A run whose last act is an asynchronous save, ending without ``engine.destroy()`` as
Hugging Face Trainer and Accelerate do (issue 40 item 4), 2 ranks, gloo, real faults.

``preemption_scripts/last_save.py`` trains two steps through the DeepSpeed door with
``async_save`` and ends right after ``engine.save_checkpoint``, its writes slowed so that the
save is still being written when the script ends:

- into a small tmpfs that a ballast file fills once rank 1 has written its file: rank 0
  fails, and rank 1, whose own part succeeded, learns rank 0's error through the c10d store;
  every rank exits with status 1 and logs the reason ("No space left on device"); nothing is
  left of the save. Before the fix both exited 0;
- nothing goes wrong, the script ends with ``destroy_process_group()``: both exit 0, the
  checkpoint is complete on disk and ``latest`` names it; a SIGTERM sent meanwhile (twice,
  as Slurm and torchrun send it) is held until the save ends.

Needs root for the tmpfs; skipped otherwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from flatzero.checkpoint import CheckpointReader, read_latest
from flatzero.ports import free_port

SCRIPT = Path(__file__).parent / "preemption_scripts" / "last_save.py"
TIMEOUT_S = 90


def launch(ckpt: Path, logs: Path, *args: str) -> list[subprocess.Popen]:
    """Start both ranks of ``last_save.py`` (their stderr to ``logs/rank<r>``)."""
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
        }
        cmd = [sys.executable, str(SCRIPT), str(ckpt), *args]
        with open(logs / f"rank{rank}", "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stderr=log))
    return procs


def finish(procs: list[subprocess.Popen], logs: Path) -> list[tuple[int, str]]:
    """Each rank's exit status and stderr."""
    try:
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(code, (logs / f"rank{r}").read_text()) for r, code in enumerate(codes)]


def test_a_failed_last_asynchronous_save_exits_non_zero_with_the_reason(
    small_disk: Path,
    tmp_path: Path,
):
    out = finish(launch(small_disk, tmp_path, "--fault", "full-late", "--slow", "0.05"), tmp_path)
    for rank, (code, err) in enumerate(out):
        assert code == 1, (rank, code, err[-3000:])
        assert "the asynchronous save of" in err and "failed" in err, (rank, err[-3000:])
        assert "No space left on device" in err, (rank, err[-3000:])
        assert "exiting with status 1" in err, (rank, err[-3000:])
    assert "rank 0: " in out[1][1], out[1][1][-3000:]  # rank 1's own part succeeded
    assert "failed on another rank" in out[1][1], out[1][1][-3000:]
    # nothing of the failed save stays; the door's zero_to_fp32.py (written by rank 0 as
    # save_checkpoint returns, as DeepSpeed copies its own) is no part of it
    left = {p.name for p in small_disk.iterdir()} - {"zero_to_fp32.py"}
    assert left == {"ballast"}, left


def test_a_last_asynchronous_save_is_complete_after_exit(tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    procs = launch(ckpt, tmp_path, "--slow", "0.3", "--destroy-group")
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and not all(
        "the interpreter exits" in (tmp_path / f"rank{r}").read_text() for r in range(2)
    ):
        time.sleep(0.05)
    assert list(ckpt.glob(".tmp-*")), "the save ended before the scripts: slow it down"
    for _ in range(2):  # SIGTERM twice, as Slurm and torchrun send it: held until it ends
        for p in procs:
            p.send_signal(signal.SIGTERM)
        time.sleep(0.1)
    out = finish(procs, tmp_path)
    for rank, (code, err) in enumerate(out):
        assert code == 0, (rank, code, err[-3000:])
        assert "SIGTERM came" in err, (rank, err[-3000:])
    assert read_latest(ckpt) == "last"
    with CheckpointReader(ckpt) as reader:
        reader.verify()
        assert reader.meta.extra["flatzero_engine"]["global_steps"] == 2
