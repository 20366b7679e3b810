"""Asynchronous saves under real faults (issue 40 items 1 and 2), 2 ranks, gloo.

- A disk that is full from the start (a small tmpfs filled by a ballast file), or that
  fills after rank 0 finished its file (rank 1 fills it from its background thread): every
  rank's ``wait_for_save`` raises within seconds an error naming the failing rank and
  "No space left on device"; no ``.tmp-*`` directory is left; once the ballast is removed
  the next save succeeds and ``latest`` names it.
- Permission denied on rank 1 only (rank 1's effective uid is ``nobody`` while it writes,
  after rank 0 finished): the same, with "Permission denied".

Before the fix each of these hung: the ranks reported through marker files in the same
directory, which failed as the write did, so rank 0 polled for 30 minutes. Each rank here
arms a watchdog (``WATCHDOG_S``) that ends it, so a regression fails instead of hanging.
Needs root (tmpfs mounts, a second uid); skipped otherwise.
- Two data-parallel subgroups reporting a save of the same name read only their own
  reports (the keys name the group's global ranks).
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import os
import time
from pathlib import Path

import pytest
import torch

from flatzero.checkpoint import load_checkpoint, read_latest, save_checkpoint
from flatzero.checkpoint.atomic import set_fault_hook
from flatzero.checkpoint.checkpointer import wait_for_save
from flatzero.checkpoint.format import FileRecord
from flatzero.checkpoint.reports import SaveReports
from flatzero.launch import run_ranks
from test_checkpoint_async import make, same, state, step

WATCHDOG_S = 90
"""A rank still running after this many seconds dumps its stacks and exits (a hang)."""
PROMPT_S = 20.0
"""The most seconds ``wait_for_save`` may take to raise a failed save's error (the write
timeout it must not wait out is 30 minutes)."""
NOBODY = 65534


def fill(disk: Path) -> None:
    """Write ``disk/ballast`` until the file system is full."""
    fd = os.open(disk / "ballast", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)


def failed_save_then_a_good_one(rank: int, ws: int, root: Path, fault: str) -> dict:
    """Save "a"; an asynchronous save of "b" meets ``fault``; wait for it (timed); save "c"
    once the fault is gone. What every rank saw."""
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    model, opt = make()
    step(model, opt, 0)
    save_checkpoint(root, opt, tag="a")
    step(model, opt, 1)
    if fault == "full" and rank == 0:
        fill(root)
    torch.distributed.barrier()

    def late_fault(point: str, r: int) -> None:
        # rank 1's snapshot copy waits until rank 0 has written its file; then the fault
        if point == "copying_snapshot" and r == 1:
            time.sleep(1.5)
            if fault == "fills late":
                fill(root)
            elif fault == "permission":
                os.seteuid(NOBODY)

    set_fault_hook(late_fault)
    t0 = time.monotonic()
    save_checkpoint(root, opt, tag="b", asynchronous=True)
    try:
        wait_for_save(opt)
        error = "no error"
    except (OSError, RuntimeError) as e:
        error = f"{type(e).__name__}: {e}"
    waited = time.monotonic() - t0
    set_fault_hook(None)
    if os.geteuid() != 0:
        os.seteuid(0)
    left = sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-"))
    torch.distributed.barrier()
    if rank == 0:
        with contextlib.suppress(FileNotFoundError):
            (root / "ballast").unlink()
    torch.distributed.barrier()
    step(model, opt, 2)
    at_c = state(opt)
    save_checkpoint(root, opt, tag="c", asynchronous=True)
    wait_for_save(opt)
    _, fresh = make()
    loaded = load_checkpoint(root, fresh).tag
    faulthandler.cancel_dump_traceback_later()
    return {
        "error": error,
        "waited": waited,
        "tmp_left": left,
        "latest": read_latest(root),
        "loaded_c": loaded == "c" and same(state(fresh), at_c),
    }


FAULTS = {
    "full": "No space left on device",
    "fills late": "No space left on device",
    "permission": "Permission denied",
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failed_asynchronous_save_is_reported_promptly_and_cleaned_up(
    small_disk: Path, fault: str
):
    root = small_disk
    if fault == "permission":
        os.chmod(root, 0o755)  # rank 1 as nobody may enter, not create
    out = run_ranks(failed_save_then_a_good_one, 2, root, fault, timeout_s=WATCHDOG_S)
    failing = 1 if fault != "full" else None
    for rank, o in enumerate(out):
        assert o["waited"] < PROMPT_S, (rank, o)
        assert FAULTS[fault] in o["error"], (rank, o["error"])
        if failing is not None:  # the rank, and the file it wrote
            assert f"rank {failing}" in o["error"], (rank, o["error"])
            assert "rank_00001-of-00002.safetensors" in o["error"], (rank, o["error"])
        else:  # every rank failed: each names itself, or rank 0 the first failing rank
            assert "rank " in o["error"], (rank, o["error"])
        assert o["tmp_left"] == [], (rank, o)
        assert o["latest"] == "c" and o["loaded_c"], (rank, o)
    assert sorted(p.name for p in root.iterdir()) == ["a", "c", "latest"]


def test_fill_stops_at_a_full_disk(small_disk: Path):
    fill(small_disk)
    with pytest.raises(OSError) as raised, open(small_disk / "more", "wb") as f:
        f.write(b"\0" * 2**16)
        f.flush()
    assert raised.value.errno == errno.ENOSPC


def reports_of_two_subgroups(rank: int, ws: int) -> list[str]:
    """Ranks {0, 1} and {2, 3}, two data-parallel groups, report a save of the same name at
    once (their tags and nonces could coincide); what each group's rank 0 collected."""
    groups = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
    mine = groups[rank // 2]
    reports = SaveReports(".tmp-step1-0123", mine, 2)
    record = FileRecord(rank=rank % 2, file=f"written by global rank {rank}", bytes=1, tensors={})
    reports.post(rank % 2, record, None)
    collected = []
    if rank % 2 == 0:
        collected = [r.file for r in reports.collect(Path("x"), 30.0, failed=lambda: None)]
    torch.distributed.barrier()
    return collected


def test_subgroups_read_only_their_own_reports():
    out = run_ranks(reports_of_two_subgroups, 4, timeout_s=60)
    assert out[0] == ["written by global rank 0", "written by global rank 1"]
    assert out[2] == ["written by global rank 2", "written by global rank 3"]
