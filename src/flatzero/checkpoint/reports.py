"""How each rank of an asynchronous save tells rank 0 that its part is done, or failed.

The background threads of a save cannot meet in a collective (one from a second thread
would interleave with training's collectives), and must not meet through files in the
checkpoint's directory: a full disk, a permission denied or a directory removed fails the
write and a marker file beside it alike, and rank 0 would wait for it until the write
timeout. So each rank's report (its file record, or its error) goes through the c10d store
of the default process group, which lives in rank 0's memory (``torchrun``'s or
``init_process_group``'s TCP store) and shares no fate with the checkpoint's file system.
Keys are namespaced by the save (its tag and rank 0's nonce) and by the global ranks of
its process group, so two data-parallel subgroups saving at once never read each other's
reports; rank 0 deletes them once it has read them. At one rank nothing leaves the process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .format import FileRecord

__all__ = ["SaveReports"]

logger = logging.getLogger(__name__)

_POLL_S = 0.02
"""Seconds between rank 0's looks for the other ranks' reports."""
LINGER_S = 60.0
"""The most seconds rank 0 waits at exit for the other ranks to read how a save ended."""


def _group_ranks(group: dist.ProcessGroup | None, world_size: int) -> list[int]:
    """The global ranks of ``group`` (None: the default group of ``world_size`` ranks)."""
    if group is None:
        return list(range(world_size))
    return dist.get_process_group_ranks(group)


class SaveReports:
    """The reports of one asynchronous save's ranks: ``post`` on every rank, ``collect`` on
    rank 0."""

    def __init__(self, save: str, group: dist.ProcessGroup | None, world_size: int) -> None:
        """Args:
        save: the save's name, the same on every rank and no other save's (its temporary
            directory's, ``.tmp-<tag>-<nonce>``).
        group: the optimizer's process group (None: the default group).
        world_size: its number of ranks."""
        self._world_size = world_size
        self._local: dict[int, dict[str, Any]] = {}
        self._store = None
        if world_size > 1:
            self._store = dist.distributed_c10d._get_default_store()
        ranks = ",".join(map(str, _group_ranks(group, world_size)))
        digest = hashlib.sha1(ranks.encode()).hexdigest()[:12]
        self._prefix = f"flatzero/async-save/{save}/{digest}/"

    def _key(self, rank: int | str) -> str:
        return f"{self._prefix}{rank}"

    def post(self, rank: int, record: FileRecord | None, error: BaseException | None) -> None:
        """Report rank ``rank``'s part (its group rank): its file ``record``, or its
        ``error``, or neither: it stopped because rank 0 abandoned the save."""
        data: dict[str, Any] = {"abandoned": True}
        if error is not None:
            data = {"error": f"{type(error).__name__}: {error}"}
        elif record is not None:
            data = {"record": dataclasses.asdict(record)}
        if self._store is None:
            self._local[rank] = data
            return
        self._store.set(self._key(rank), json.dumps(data))
        if error is not None:
            self._store.add(self._key("failed"), 1)
        self._store.add(self._key("reported"), 1)  # last: its data is in

    def abandon(self) -> None:
        """(Rank 0, once a rank reported an error, before it removes the temporary
        directory.) Tell the ranks still writing that a write failing from now on failed
        because of that removal, not on its own (``abandoned``)."""
        if self._store is not None:
            self._store.set(self._key("abandoned"), "1")

    def abandoned(self) -> bool:
        """Whether rank 0 abandoned the save (``abandon``): a rank whose write failed then
        reports neither a record nor its error (the error that made rank 0 abandon it is
        the one every rank raises)."""
        return self._store is not None and self._store.check([self._key("abandoned")])

    def _reported(self) -> int:
        """How many ranks reported (one store operation, whatever the world size)."""
        if self._store is None:
            return len(self._local)
        return self._store.add(self._key("reported"), 0)

    def _any_failed(self) -> bool:
        """Whether a rank reported an error."""
        if self._store is None:
            return any("error" in d for d in self._local.values())
        return self._store.check([self._key("failed")])

    def _missing(self) -> list[int]:
        """The ranks that have not reported."""
        if self._store is None:
            return [r for r in range(self._world_size) if r not in self._local]
        return [r for r in range(self._world_size) if not self._store.check([self._key(r)])]

    def _take_all(self) -> list[dict[str, Any]]:
        """Every rank's report, in rank order, removed from the store with the counters."""
        if self._store is None:
            return [self._local.pop(r) for r in range(self._world_size)]
        store = self._store
        reports = [json.loads(store.get(self._key(r))) for r in range(self._world_size)]
        for key in [*range(self._world_size), "reported", "failed", "abandoned"]:
            store.delete_key(self._key(key))
        return reports

    def post_outcome(self, error: BaseException | None) -> None:
        """(Rank 0, once the save is published or failed.) Leave how it ended in the store,
        for ranks that exit before the ranks agree on it (``outcome``)."""
        if self._store is None:
            return
        text = "" if error is None else f"{type(error).__name__}: {error}"
        try:
            self._store.set(self._key("outcome"), text)
        except Exception as e:  # the store is gone: the ranks learn it in their wait
            logger.warning("could not leave the asynchronous save's outcome in the store: %s", e)

    def settle(self, rank: int, timeout_s: float) -> str | None:
        """(At exit, after this rank's thread ended; no collective.) On a rank other than 0:
        rank 0's error for the save (``post_outcome``), waited for at most ``timeout_s``
        seconds, None when it was published or cannot be learnt (the store's host exited,
        or no outcome in time: logged, as this rank's own part succeeded); then it says it
        read it. On rank 0: wait until every other rank read it (at most
        ``min(timeout_s, LINGER_S)``: a store rank 0 hosts ends with its process); None.
        Never raises."""
        if self._store is None:
            return None
        store, key = self._store, self._key("outcome")
        try:
            if rank == 0:
                deadline = time.monotonic() + min(timeout_s, LINGER_S)
                while store.add(self._key("outcome-read"), 0) < self._world_size - 1:
                    if time.monotonic() > deadline:
                        return None
                    time.sleep(_POLL_S)
                return None
            store.wait([key], timedelta(seconds=max(timeout_s, 0.001)))
            text = store.get(key).decode()
            store.add(self._key("outcome-read"), 1)
        except Exception as error:
            logger.warning("rank 0's outcome of the asynchronous save is unknown: %s", error)
            return None
        return text or None

    def forget_outcome(self) -> None:
        """(Rank 0, once every rank agreed how the save ended.) Drop its outcome."""
        if self._store is not None:
            self._store.delete_key(self._key("outcome"))
            self._store.delete_key(self._key("outcome-read"))

    def collect(
        self,
        tmp: Path,
        timeout_s: float,
        failed: Callable[[], None],
        given_up: threading.Event | None = None,
    ) -> list[FileRecord]:
        """(Rank 0.) Every rank's file record, in rank order, once every rank reported.
        Rank 0 polls two counters in the store (``_POLL_S``), not one key per rank. As
        soon as an error is in while ranks still write, the save is ``abandon``-ed and
        ``failed()`` runs (rank 0 removes the temporary directory then, not after the
        slowest rank). It stops waiting when ``given_up`` is set (the main thread found
        ranks not responding: ``checkpointer.BackgroundSave.wait``).

        Raises:
            RuntimeError: a rank reported an error (naming the first such rank and its
                error; the reports of all ranks are waited for first), or not every rank
                reported within ``timeout_s`` seconds (naming them).
        """
        start = time.monotonic()
        abandoned = False
        while self._reported() < self._world_size:
            if not abandoned and self._any_failed():
                abandoned = True
                self.abandon()
                failed()
            waited = time.monotonic() - start
            if waited > timeout_s or (given_up is not None and given_up.is_set()):
                raise RuntimeError(
                    f"ranks {self._missing()} did not report on writing into {tmp} within "
                    f"{waited:.0f} s"
                )
            time.sleep(_POLL_S)
        reports = self._take_all()
        errors = [r for r, data in enumerate(reports) if "error" in data]
        if errors:
            raise RuntimeError(
                f"rank {errors[0]} failed to write its file into {tmp}: "
                f"{reports[errors[0]]['error']}"
            )
        return [FileRecord(**data["record"]) for data in reports]
