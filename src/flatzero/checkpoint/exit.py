"""Asynchronous saves still pending when the interpreter exits: finished, and a failure is loud.

Hugging Face Trainer and Accelerate never call ``engine.destroy()``, and a script's last act
is often an asynchronous save; nothing then waits for it but the interpreter's exit. The
background threads of a save are daemons, so the interpreter's own join of non-daemon
threads (unbounded, and broken off by a second signal) never holds them; instead
``at_exit`` (registered with ``atexit`` at the first asynchronous save) waits for every
pending save of the process:

- with SIGTERM held: a handler that only notes it is installed for the signal (the
  disposition is the process's, so no thread of the process dies of it) and the main thread
  blocks it (``signal.pthread_sigmask``), so a scheduler's second SIGTERM cannot interrupt
  the wait; SIGKILL still ends the process;
- with no collective (the process group may already be destroyed, the other ranks gone): the
  thread is joined, then a rank other than 0 asks the c10d store for rank 0's outcome, if
  the store is still reachable, and rank 0 waits a little for the others to read it
  (``BackgroundSave.outcome``: ``reports.SaveReports.settle``);
- for at most the save's write timeout (``BackgroundSave.timeout_s``).

A save that failed here (its own error, another rank's error learnt from the store, or no
end within the timeout) is logged with its reason and the process exits with status 1
(``os._exit`` after flushing the standard streams and the logging handlers: an exception
raised in an ``atexit`` handler cannot change the exit status).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

__all__ = ["EXIT_FAILED_SAVE", "at_exit", "track", "untrack"]

logger = logging.getLogger(__name__)

EXIT_FAILED_SAVE = 1
"""The exit status of a process whose pending asynchronous save failed at exit."""


class PendingSave(Protocol):
    """What ``at_exit`` needs of a pending save (``checkpointer.BackgroundSave``)."""

    thread: threading.Thread
    path: Path
    error: BaseException | None
    timeout_s: float
    outcome: Callable[[float], str | None] | None


_pending: list[PendingSave] = []
"""The saves started and not yet waited for, oldest first."""
_registered = False


def track(save: PendingSave) -> None:
    """Wait for ``save`` at interpreter exit unless ``untrack``-ed first (registers
    ``at_exit`` with ``atexit`` at the first call)."""
    global _registered
    _pending.append(save)
    if not _registered:
        atexit.register(at_exit)
        _registered = True


def untrack(save: PendingSave) -> None:
    """``save`` was waited for: nothing to do at exit."""
    with contextlib.suppress(ValueError):
        _pending.remove(save)


@contextlib.contextmanager
def _sigterm_held() -> Iterator[list[float]]:
    """SIGTERM only noted (the times it came, in the yielded list) while the body runs, in
    the main thread; elsewhere (a thread may not set handlers) nothing changes."""
    came: list[float] = []
    if threading.current_thread() is not threading.main_thread():
        yield came
        return
    previous = signal.signal(signal.SIGTERM, lambda _signum, _frame: came.append(time.monotonic()))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield came
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _failure(save: PendingSave, deadline: float) -> str | None:
    """Why ``save`` failed (its thread joined until ``deadline``, a ``time.monotonic()``),
    or None when it is complete (as far as this rank can learn). Once the thread ended,
    ``save.outcome`` runs whatever this rank's own result (rank 0 waits there for the others
    to read how the save ended)."""
    save.thread.join(max(0.0, deadline - time.monotonic()))
    if save.thread.is_alive():
        return (
            f"the asynchronous save of {save.path} did not finish within {save.timeout_s:.0f} s "
            "of the interpreter's exit; it was not published"
        )
    others = None
    if save.outcome is not None:
        others = save.outcome(max(0.0, deadline - time.monotonic()))
    if save.error is not None:
        return f"the asynchronous save of {save.path} failed: {save.error}"
    if others is not None:
        return f"the asynchronous save of {save.path} failed on another rank: {others}"
    return None


def at_exit() -> None:
    """Wait for every pending asynchronous save (see the module's docstring); exit with
    status ``EXIT_FAILED_SAVE`` if any failed, after logging why."""
    if not _pending:
        return
    t0 = time.monotonic()
    failures = []
    with _sigterm_held() as came:
        logger.info(
            "the interpreter exits: waiting for %d asynchronous save(s), SIGTERM held",
            len(_pending),
        )
        while _pending:
            save = _pending.pop(0)
            reason = _failure(save, t0 + save.timeout_s)
            if reason is not None:
                failures.append(reason)
    waited = time.monotonic() - t0
    if came:
        logger.warning(
            "SIGTERM came %d time(s) while the interpreter finished an asynchronous save; "
            "it was held until the save ended (%.1f s)",
            len(came),
            waited,
        )
    if not failures:
        if waited > 0.1:
            logger.info("waited %.2f s at exit for the asynchronous save", waited)
        return
    for reason in failures:
        logger.error("%s; exiting with status %d", reason, EXIT_FAILED_SAVE)
    with contextlib.suppress(Exception):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(EXIT_FAILED_SAVE)
