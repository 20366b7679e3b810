"""The asynchronous save's CPU work yields the cores to training; its writes do not wait."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from flatzero.checkpoint import async_save, checkpointer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux policies")


def test_lower_priority_makes_only_the_calling_thread_sched_idle():
    seen = {}

    def job():
        async_save.lower_priority()
        seen["policy"] = os.sched_getscheduler(threading.get_native_id())

    before = os.sched_getscheduler(threading.get_native_id())
    thread = threading.Thread(target=job)
    thread.start()
    thread.join()
    assert seen["policy"] == os.SCHED_IDLE
    assert os.sched_getscheduler(threading.get_native_id()) == before


def policies_in_a_save(rank: int, ws: int, base: str) -> dict:
    """The scheduling policy of the thread at each fault point of an asynchronous save."""
    from flatzero.checkpoint import save_checkpoint
    from flatzero.checkpoint.atomic import set_fault_hook
    from test_checkpoint_async import make, step

    seen: dict[str, int] = {}

    def record(point: str, _rank: int) -> None:
        seen.setdefault(point, os.sched_getscheduler(threading.get_native_id()))

    model, opt = make()
    step(model, opt, 0)
    set_fault_hook(record)
    save_checkpoint(base, opt, tag="a", asynchronous=True)
    checkpointer.wait_for_save(opt)
    set_fault_hook(None)
    return seen


def test_the_hasher_is_sched_idle_and_the_writer_keeps_the_callers_priority(tmp_path):
    """The copies and checksums run in an idle-priority thread; the writes are issued by a
    thread at the caller's priority, so a busy machine cannot keep the disk idle."""
    from flatzero.launch import run_ranks

    (seen,) = run_ranks(policies_in_a_save, 1, str(tmp_path), timeout_s=120)
    assert seen["copying_snapshot"] == os.SCHED_IDLE
    assert seen["tensor_written"] == os.SCHED_OTHER
    assert seen["snapshot_taken"] == os.SCHED_OTHER  # the caller's own thread


def test_without_sched_idle_the_writer_runs_at_nice_19(tmp_path, monkeypatch):
    def refuse(*args):
        raise PermissionError("not allowed here")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    seen = {}

    def job():
        async_save.lower_priority()
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    thread = threading.Thread(target=job)
    thread.start()
    thread.join()
    assert seen["nice"] == async_save.WRITER_NICE
