"""What outlives one save of an optimizer: its snapshot buffer and its save in the background.

A ``Checkpointer`` per optimizer (``checkpointer_of``) holds the host buffer asynchronous
saves lay their snapshot out in (allocated at the first, reused by the next ones, grown
when the state grows) and the background save still being written (``BackgroundSave``:
its thread and how it ended). The next ``save_checkpoint``, ``load_checkpoint`` or
``engine.destroy()`` first waits for that save (``wait_for_save``): every rank joins its
thread, then the ranks agree (one all-reduce on the control group), so an error in any
rank's background write, or in rank 0's publishing, is raised there on every rank. A
process that exits without waiting finishes the save at exit, and exits with status 1 if
it failed (``exit``: the thread is a daemon that ``exit.at_exit`` waits for, SIGTERM held).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..comm import world_size_of
from ..control import RanksNotResponding, raise_if_any_failed, wait_for_host_work
from ..hostmem import StagingBuffer, mapped_host, page_locked
from ..optim import ZeroOptimizer
from .exit import track, untrack

__all__ = ["BackgroundSave", "Checkpointer", "checkpointer_of", "release_snapshot", "wait_for_save"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class BackgroundSave:
    """A save being written by a thread of its own: the future ``wait`` resolves.

    Attributes:
        thread: the thread that writes and publishes.
        path: where the checkpoint appears.
        group: the process group whose ranks agree on how it ended.
        timeout_s: the most seconds the save may take (its write timeout): how long the
            interpreter's exit waits for it (``exit``).
        outcome: given the seconds it may wait, why the save failed on another rank, or
            None (at exit, through the c10d store, once this rank's own part succeeded:
            ``reports.SaveReports.settle``; None: nothing to ask).
        forget: run on every rank once the ranks agreed how the save ended (rank 0 drops
            its outcome from the store).
        nbytes: the most bytes a rank writes (sizes the ranks' wait for each other).
        given_up: set when rank 0 found ranks not responding, so that its thread stops
            waiting for their reports (and the process can exit).
        error: what the thread raised (None: nothing, or not yet).
    """

    thread: threading.Thread
    path: Path
    group: dist.ProcessGroup | None
    timeout_s: float
    outcome: Callable[[float], str | None] | None = None
    forget: Callable[[], None] | None = None
    nbytes: int = 0
    error: BaseException | None = None
    given_up: threading.Event = field(default_factory=threading.Event)

    def wait(self) -> None:
        """Join the thread once the ranks met, then raise its error on every rank
        (collective over ``group``).

        The ranks meet on their main threads (``control.wait_for_host_work``, allowing for
        ``nbytes``): the others after joining their threads (which reported their part
        before ending), rank 0 before joining its own (which waits for those reports). So a
        rank that died is named at once, and one that stopped responding once the job's
        timeout has passed, never left to rank 0's wait for its report or to the process
        group's own timeout in the all-reduce that follows.

        Raises:
            The background error on the rank it happened on; ``RuntimeError`` on the others;
            ``RanksNotResponding`` naming the ranks that did not come in time.
        """
        first = world_size_of(self.group) == 1 or dist.get_rank(self.group) == 0
        if first:
            try:
                wait_for_host_work(self.group, self.nbytes)
            except RanksNotResponding:
                self.given_up.set()  # the thread stops waiting for their reports
                raise
        t0 = time.perf_counter()
        self.thread.join()
        untrack(self)  # after the join: a wait broken off (Ctrl-C) leaves it to the exit
        waited = time.perf_counter() - t0
        if waited > 0.1:
            logger.info("waited %.2f s for the asynchronous save of %s", waited, self.path)
        if not first:
            wait_for_host_work(self.group, self.nbytes)
        try:
            raise_if_any_failed(
                self.error,
                self.group,
                f"the asynchronous save of {self.path} failed on another rank (see its error)",
            )
        finally:
            if self.forget is not None:
                self.forget()


def _allocate(nbytes: int, pin: bool, device: torch.device | None) -> StagingBuffer:
    """``nbytes`` (a multiple of the page) of page-aligned host memory, page-locked for
    copies from ``device`` if ``pin`` and possible (``hostmem.page_locked``). A mapping of
    its own on huge pages (``hostmem.mapped_host``), so that its pages stay with it, faulted
    in once, from the first save to the last."""
    if pin:
        return page_locked(nbytes, device=device)
    return StagingBuffer(mapped_host(nbytes), pinned=False)


class Checkpointer:
    """One optimizer's checkpointing state across saves.

    Attributes:
        snapshot: the host buffer of asynchronous saves (None until the first).
        pending: the save still being written in the background (None: none).
    """

    def __init__(self) -> None:
        self.snapshot: StagingBuffer | None = None
        self.pending: BackgroundSave | None = None

    def buffer(self, nbytes: int, pin: bool, device: torch.device | None = None) -> StagingBuffer:
        """The snapshot buffer, of at least ``nbytes`` bytes, page-locked with ``pin`` for
        copies from ``device``: the one kept, or a new one where that is too small (or not
        page-locked as needed).

        Raises:
            RuntimeError / OSError: out of host memory.
        """
        buffer = self.snapshot
        if buffer is None or buffer.data.numel() < nbytes or (pin and not buffer.pinned):
            self.release_snapshot()
            buffer = self.snapshot = _allocate(nbytes, pin, device)
        return buffer

    def release_snapshot(self) -> None:
        """Free the snapshot buffer (the next asynchronous save allocates anew).

        Raises:
            RuntimeError: a save is pending (``wait`` first).
        """
        if self.pending is not None:
            raise RuntimeError(
                "an asynchronous save of this optimizer is still pending: call "
                "wait_for_save(optimizer) before release_snapshot(optimizer)"
            )
        buffer, self.snapshot = self.snapshot, None
        if buffer is not None:
            buffer.release()

    def start(
        self,
        job: Callable[[], None],
        path: Path,
        group: dist.ProcessGroup | None,
        *,
        timeout_s: float,
        outcome: Callable[[float], str | None] | None = None,
        forget: Callable[[], None] | None = None,
        nbytes: int = 0,
    ) -> BackgroundSave:
        """Run ``job`` (the write and publish of the checkpoint at ``path``) in a background
        thread at the caller's priority (it mostly sleeps in the kernel while the disk reads
        the snapshot); ``wait`` joins it, else the interpreter's exit does (``exit.track``;
        ``timeout_s``, ``outcome``, ``forget``: see ``BackgroundSave``)."""

        def run() -> None:
            try:
                job()
            except BaseException as error:
                pending.error = error
                logger.error("asynchronous save of %s failed: %s", path, error)

        thread = threading.Thread(target=run, name=f"flatzero-save-{path.name}", daemon=True)
        pending = self.pending = BackgroundSave(
            thread, path, group, timeout_s, outcome, forget, nbytes
        )
        track(pending)
        thread.start()
        return pending

    def wait(self) -> None:
        """Wait for the pending save, if any, and raise its error on every rank
        (``BackgroundSave.wait``); nothing otherwise."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait()


_checkpointers: weakref.WeakKeyDictionary[ZeroOptimizer, Checkpointer] = weakref.WeakKeyDictionary()


def checkpointer_of(optimizer: ZeroOptimizer) -> Checkpointer:
    """``optimizer``'s checkpointer (made at the first call; it lives as long as the
    optimizer)."""
    found = _checkpointers.get(optimizer)
    if found is None:
        found = _checkpointers[optimizer] = Checkpointer()
    return found


def wait_for_save(optimizer: ZeroOptimizer) -> None:
    """Wait for ``optimizer``'s asynchronous save, if any; raise its error on every rank.

    Collective over the optimizer's process group when a save is pending (every rank has
    one then: they started it together); nothing otherwise.

    Raises:
        The background error on the rank it happened on; ``RuntimeError`` on the others.
    """
    found = _checkpointers.get(optimizer)
    if found is not None:
        found.wait()


def release_snapshot(optimizer: ZeroOptimizer) -> None:
    """Free ``optimizer``'s snapshot buffer (the next asynchronous save allocates anew).

    Raises:
        RuntimeError: a save of it is pending (``wait_for_save`` first).
    """
    found = _checkpointers.get(optimizer)
    if found is not None:
        found.release_snapshot()
