"""The asynchronous save's background thread yields the cores to training."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from flatzero.checkpoint import async_save

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux policies")


class _Owner:
    """Stands for the optimizer a save belongs to (weakly referenced)."""


def test_the_writer_thread_is_sched_idle_and_the_caller_unchanged(tmp_path):
    seen = {}

    def job():
        tid = threading.get_native_id()
        seen["policy"] = os.sched_getscheduler(tid)

    owner = _Owner()
    before = os.sched_getscheduler(threading.get_native_id())
    async_save.start(owner, job, tmp_path / "tag", None)
    async_save.wait_for_save(owner)
    assert seen["policy"] == os.SCHED_IDLE
    assert os.sched_getscheduler(threading.get_native_id()) == before


def test_without_sched_idle_the_writer_runs_at_nice_19(tmp_path, monkeypatch):
    def refuse(*args):
        raise PermissionError("not allowed here")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    seen = {}

    def job():
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    owner = _Owner()
    async_save.start(owner, job, tmp_path / "tag", None)
    async_save.wait_for_save(owner)
    assert seen["nice"] == async_save.WRITER_NICE
