"""Host-side agreement between ranks, on the control group: every rank raises when one
failed (``every_rank_or_none``), and ranks wait for each other's host work with a timeout
that names the ranks that did not come (``wait_for_host_work``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType
from typing import NamedTuple

import torch
import torch.distributed as dist

from .comm import all_reduce_max, world_size_of
from .own_groups import control_group
from .process_group import job_timeout

__all__ = [
    "ErrorFactory",
    "Failures",
    "RankError",
    "RanksNotResponding",
    "any_rank_failed",
    "every_rank_or_none",
    "host_work_timeout",
    "raise_if_any_failed",
    "wait_for_host_work",
]

logger = logging.getLogger(__name__)

_SLOWEST_DISK_BYTES_PER_S = 20e6
"""The slowest write rate a checkpoint's timeout allows for (20 MB/s: a busy network
file system), so that only a hung rank, never a slow disk, times out."""


def host_work_timeout(nbytes: int) -> timedelta:
    """How long ranks may wait for one rank's host-side work over ``nbytes`` (a checkpoint
    write): the job's timeout (``process_group.job_timeout``: ``FLATZERO_TIMEOUT`` seconds,
    else ``DEEPSPEED_TIMEOUT`` minutes, else 30 minutes), more for writes that take longer
    at 20 MB/s."""
    slowest = timedelta(seconds=math.ceil(nbytes / _SLOWEST_DISK_BYTES_PER_S))
    return max(job_timeout(), slowest)


class RanksNotResponding(RuntimeError):
    """Ranks did not reach a wait for host work within its timeout (stopped, hung, dead or
    far slower than the slowest disk allowed for)."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks
        """Their global ranks."""


def _not_responding(ranks: list[int], timeout: timedelta, errors: list[str]) -> RanksNotResponding:
    said = f" ({errors[0]})" if errors else ""
    return RanksNotResponding(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} did not reach "
        f"flatzero's wait for the other ranks' host work (a checkpoint's write or a load's "
        f"read) within {timeout.total_seconds():g} s: stopped, hung or dead{said}. The wait "
        "is the job's timeout (FLATZERO_TIMEOUT seconds, else DEEPSPEED_TIMEOUT minutes) or "
        "longer for large writes",
        ranks,
    )


_VERDICT_WAIT = timedelta(seconds=10)
"""How long a rank whose connection to rank 0 broke waits for rank 0's verdict in the
store (rank 0 writes it as soon as its own wait ended)."""

_waits: dict[tuple[int, ...], int] = {}
"""How many host-work waits this process made per control group (the same count on every
rank of it: the wait is collective), to name each wait's verdict in the store."""


class _WaitKeys(NamedTuple):
    """The c10d store keys of one host-work wait ([Note: a late rank's verdict])."""

    number: str
    """Which wait of its control group this is (the same on every rank)."""
    prefix: str
    """The control group's keys' prefix."""

    @classmethod
    def next(cls, peers: list[int]) -> _WaitKeys:
        key = tuple(peers)
        _waits[key] = _waits.get(key, 0) + 1
        return cls(str(_waits[key]), f"flatzero/host-work/{','.join(map(str, peers))}/")

    @property
    def verdict(self) -> str:
        """The ranks rank 0 found missing at this wait (written only when some were)."""
        return f"{self.prefix}verdict/{self.number}"

    def arrived(self, rank: int) -> str:
        """The number of the last wait group rank ``rank`` reached (one key per rank,
        overwritten by each wait)."""
        return f"{self.prefix}arrived/{rank}"


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _wait_for_peers(
    control: dist.ProcessGroup, peers: list[int], timeout: timedelta, keys: _WaitKeys
) -> None:
    """(The control group's rank 0.) Wait for a token from every peer until ``timeout``
    has passed; then tell the others which peers did not come (flags per group rank), and
    raise naming them.

    [Note: a late rank's verdict] A gloo wait that times out closes every connection of
    the group (gloo's ``signalException``): the waits for peers that did come then fail
    too, and those peers learn of it only as "closed by peer". So each rank also records
    its arrival in the c10d store (one key per rank, overwritten by each wait), rank 0
    names as late only those that did not record it, and writes that verdict to the store
    before answering, where the others look when their connection to rank 0 breaks."""
    deadline = time.monotonic() + timeout.total_seconds()
    tokens = [torch.zeros(1, dtype=torch.uint8) for _ in peers[1:]]
    works = [dist.irecv(t, src=p, group=control) for t, p in zip(tokens, peers[1:], strict=True)]
    failed: list[int] = []
    errors: list[str] = []
    for index, work in enumerate(works, start=1):
        left = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        try:
            work.wait(left)
        except RuntimeError as error:  # timed out, or the peer's connection closed
            failed.append(index)
            errors.append(str(error).splitlines()[0][:200])
    late = [r for r in failed if not _arrived(keys, r)]
    if failed:
        _store().set(keys.verdict, json.dumps(late or failed))
    flags = torch.zeros(len(peers), dtype=torch.uint8)
    flags[late] = 1
    with contextlib.suppress(RuntimeError) if failed else contextlib.nullcontext():
        for work in [
            dist.isend(flags, dst=p, group=control)
            for r, p in enumerate(peers)
            if r != 0 and r not in failed
        ]:
            work.wait(timeout)
    if failed:
        raise _not_responding([peers[r] for r in late or failed], timeout, errors)


def _arrived(keys: _WaitKeys, rank: int) -> bool:
    """Whether group rank ``rank`` recorded reaching this wait in the store."""
    store = _store()
    key = keys.arrived(rank)
    return store.check([key]) and store.get(key).decode() == keys.number


def _rank0_verdict(keys: _WaitKeys) -> list[int] | None:
    """The group ranks rank 0 found missing (``_wait_for_peers``), or None when it wrote
    no verdict within ``_VERDICT_WAIT``."""
    store = _store()
    try:
        store.wait([keys.verdict], _VERDICT_WAIT)
        return list(json.loads(store.get(keys.verdict)))
    except (RuntimeError, ValueError):  # DistStoreError is a RuntimeError
        return None


def _wait_for_rank0(
    control: dist.ProcessGroup, peers: list[int], timeout: timedelta, keys: _WaitKeys
) -> None:
    """(Any other rank of the control group.) Send rank 0 a token and wait for its answer,
    allowing it twice ``timeout`` to arrive (it may come from a wait of its own, e.g. for
    an asynchronous save's reports) and as long to wait for the others; raise naming
    the ranks rank 0 says did not come (in its answer, or in the store when the
    connection broke: [Note: a late rank's verdict]), else rank 0 itself."""
    token = torch.zeros(1, dtype=torch.uint8)
    flags = torch.zeros(len(peers), dtype=torch.uint8)
    _store().set(keys.arrived(dist.get_rank(control)), keys.number)
    try:
        dist.isend(token, dst=peers[0], group=control).wait(2 * timeout)
        dist.irecv(flags, src=peers[0], group=control).wait(2 * timeout)
    except RuntimeError as error:
        late = _rank0_verdict(keys)
        if late is None:
            said = [str(error).splitlines()[0][:200]]
            raise _not_responding([peers[0]], 2 * timeout, said) from None
        raise _not_responding([peers[r] for r in late], timeout, []) from None
    late = [peers[r] for r in flags.nonzero().flatten().tolist()]
    if late:
        raise _not_responding(late, timeout, [])


def wait_for_host_work(group: dist.ProcessGroup | None, nbytes: int) -> None:
    """Wait, on the control group, until every rank of ``group`` got here, allowing the
    slowest of them ``host_work_timeout(nbytes)``. Collective.

    A star of point-to-point messages through the control group's rank 0, each waited
    with that timeout (``dist.monitored_barrier`` applies its timeout on rank 0 only, and
    takes plain gloo groups only). Rank 0 tells the others which ranks did not come.

    Raises:
        RanksNotResponding: on every rank that got here, naming (global ranks) those that
            did not within the timeout (a stopped or hung process; a dead one at once).
    """
    control = control_group(group)
    size = world_size_of(control)
    if size == 1:
        return
    if control is None:  # the default group
        control = dist.group.WORLD
    timeout = host_work_timeout(nbytes)
    peers = [dist.get_global_rank(control, r) for r in range(size)]
    keys = _WaitKeys.next(peers)
    if dist.get_rank(control) == 0:
        _wait_for_peers(control, peers, timeout, keys)
    else:
        _wait_for_rank0(control, peers, timeout, keys)


_ERROR_CHARS = 1000
"""The most characters of a rank's error passed on to the other ranks."""

_Simple = str | int | float | bool | None


class RankError(NamedTuple):
    """The first failing rank's error, as every rank of the group learns it."""

    rank: int
    """Its rank in the control group."""
    kind: str
    """Its exception's class name."""
    message: str
    """``str(error)``, at most ``_ERROR_CHARS`` characters."""
    fields: dict[str, _Simple]
    """The exception's own attributes with simple values (e.g. a config key), so that other
    ranks can raise an error of the same kind."""


class Failures(NamedTuple):
    """What every rank knows once some rank of the group failed."""

    mine: BaseException | None
    """This rank's own error, or None."""
    first: RankError
    """The first failing rank's error."""
    kinds: tuple[str, ...]
    """Every failing rank's exception class name, in rank order."""


ErrorFactory = Callable[[Failures], BaseException]
"""The error a rank raises once some rank failed (its own, or one naming the first)."""


def _describe(error: BaseException) -> tuple[str, str, dict[str, _Simple]]:
    fields = {
        k: v for k, v in vars(error).items() if not k.startswith("_") and isinstance(v, _Simple)
    }
    return type(error).__name__, str(error)[:_ERROR_CHARS], fields


def any_rank_failed(error: BaseException | None, group: dist.ProcessGroup | None) -> bool:
    """Whether any rank of ``group`` passed an ``error`` (the same answer on every rank).

    Collective: one all-reduce on ``group``'s control group (gloo, never queued
    behind GPU work), so a failure on one rank never leaves the others
    waiting in their next collective.
    """
    return all_reduce_max(int(error is not None), control_group(group)) > 0


def _failures(error: BaseException | None, group: dist.ProcessGroup | None) -> Failures:
    """(Called once some rank failed; collective.) Every failing rank's error, gathered."""
    control = control_group(group)
    found: list[tuple[str, str, dict[str, _Simple]] | None] = [None] * world_size_of(control)
    mine = None if error is None else _describe(error)
    if len(found) > 1:
        dist.all_gather_object(found, mine, group=control)
    else:
        found[0] = mine
    failed = [(r, f) for r, f in enumerate(found) if f is not None]
    rank, (kind, message, fields) = failed[0]
    return Failures(error, RankError(rank, kind, message, fields), tuple(f[0] for _, f in failed))


def raise_if_any_failed(
    error: BaseException | None,
    group: dist.ProcessGroup | None,
    elsewhere: str,
    *,
    error_type: type[Exception] | ErrorFactory = RuntimeError,
) -> None:
    """Raise on every rank of ``group`` when any rank failed: a rank's own ``error``, or on
    the ranks that had none ``error_type(elsewhere + ": rank R: Kind: message")`` naming the
    first failing rank's error, so that every rank's message says what was wrong. An
    ``ErrorFactory`` instead decides every rank's error from the ``Failures``. Collective
    (``any_rank_failed``; the errors are gathered only when one failed).

    Args:
        error: this rank's error, or None.
        group: the ranks that agree (their control group takes the all-reduce).
        elsewhere: the message on ranks without an error of their own ("saving the
            checkpoint failed on another rank (see its error)").
        error_type: the exception those ranks raise, or a factory of every rank's error.
    """
    if not any_rank_failed(error, group):
        return
    failures = _failures(error, group)
    if not isinstance(error_type, type):
        raise error_type(failures)
    if error is not None:
        raise error
    first = failures.first
    raise error_type(f"{elsewhere}: rank {first.rank}: {first.kind}: {first.message}")


class every_rank_or_none:
    """Every rank raises or none: the one idiom for work that may fail on some ranks before
    a collective that every rank must enter.

    ``with every_rank_or_none(group, "saving failed on another rank"): work()`` runs the
    work; an exception of a ``catch`` type is not raised at once but agreed on (on the
    control group, after the optional ``wait_bytes`` host-work wait): the failing rank
    raises its own error, every other rank ``error_type`` naming it (see
    ``raise_if_any_failed``). An exception of another type propagates on its rank alone,
    as a bug does. Collective on leaving the block.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        elsewhere: str = "",
        *,
        catch: tuple[type[BaseException], ...] = (Exception,),
        error_type: type[Exception] | ErrorFactory = RuntimeError,
        wait_bytes: int | None = None,
    ) -> None:
        self.group = group
        self.elsewhere = elsewhere
        self.catch = catch
        self.error_type = error_type
        self.wait_bytes = wait_bytes

    def __enter__(self) -> every_rank_or_none:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if exc is not None and not isinstance(exc, self.catch):
            return False
        if self.wait_bytes is not None:
            wait_for_host_work(self.group, self.wait_bytes)
        try:
            raise_if_any_failed(exc, self.group, self.elsewhere, error_type=self.error_type)
        except BaseException as raised:
            if raised is exc:
                return False  # this rank's own error goes on with its own traceback
            raise
        return False
