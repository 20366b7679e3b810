"""Naming the ranks that stopped answering when a collective of the training step fails.

A gloo collective whose peer was stopped (SIGSTOP, a debugger, a frozen host) fails after
the group's timeout with "Timed out waiting 3000ms for send operation to complete"; one
whose peer died fails at once with "Connection reset by peer". Neither names the rank.
The optimizer's collectives (the gradient reductions during backward and at the step, the
norm's all-reduce, the parameter all-gathers) catch such an error where they wait for it
and call ``raise_naming_ranks``: each rank that got there posts "alive, after N steps,
doing X" in the c10d store (the rendezvous store, which the failed group does not carry)
and waits a short while (``roll_call_timeout``) for the others' posts. A rank that did not
post is named, with what this machine knows of its process when it runs here (stopped,
dead, or running but elsewhere), and every rank raises ``StepCollectiveFailed``, chained
to the collective's own error.

[Note: nothing on the happy path] A ``try``/``except`` around a wait costs nothing until it
catches (Python 3.11's zero-cost exceptions): no extra collective, host sync or store
traffic per step. The store is written once per process and group when an optimizer is
built (this process's id: ``progress_of``), and otherwise only after a collective failed.

[Note: the roll call is bounded] Its store client is a clone whose every operation times
out after ``roll_call_timeout`` (at most 5 s, never more than the job's timeout), so a
rank never waits longer than that for the others once its collective failed; a rank whose
process is stopped or dead on this machine is not waited for at all. Where the store
itself does not answer (its host is the stopped process: rank 0 without torchrun's agent)
even the clone's connection blocks, whatever its timeout; so the roll call runs in a
thread of its own, given up ``_STORE_GRACE_S`` after its timeout, and the error says the
store did not answer. A group fails once: a later failure on it (a wait for a reduction
still in flight) repeats the first verdict without asking again.

[Note: a rank's own device error is not a roll call] An out-of-memory error or an
accelerator error raised inside a collective is this rank's own, not a peer's silence:
waiting for the others (who wait in the collective for this rank) would only name healthy
ranks as "did not respond" and turn the error into another type, which a caller catching
``torch.OutOfMemoryError`` (an automatic batch-size search) would no longer catch. Such an
error is posted, so that the others' roll call shows it, and re-raised unchanged at once.

NCCL: by default (``TORCH_NCCL_ASYNC_ERROR_HANDLING``) a timed-out NCCL collective is
aborted by torch's watchdog, which ends the process; ``work.wait()`` raises only with
``TORCH_NCCL_BLOCKING_WAIT=1``, and then the same roll call runs (the store is TCP, never
NCCL).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from .process_group import job_timeout
from .words import plural

__all__ = [
    "GATHERING",
    "Progress",
    "StepCollectiveFailed",
    "progress_of",
    "raise_naming_ranks",
    "roll_call_timeout",
]

GATHERING = "gathering the updated parameters"
"""What a rank does in the parameter all-gathers that end a step (or a load)."""

_ROLL_CALL_MOST = timedelta(seconds=5)
"""The longest a rank waits for the others' posts once its collective failed."""

_POLL_S = 0.02
"""Seconds between two looks at the store for posts not there yet."""

_STORE_GRACE_S = 2.0
"""Seconds beyond the roll call's timeout after which a roll call whose store did not
answer is given up ([Note: the roll call is bounded])."""

_ERROR_CHARS = 300
"""The most characters of a rank's collective error in its post."""

_OWN_ERRORS: tuple[type[BaseException], ...] = (torch.OutOfMemoryError, torch.AcceleratorError)
"""Errors of this rank's own device ([Note: a rank's own device error is not a roll call])."""


def roll_call_timeout() -> timedelta:
    """How long a rank whose collective failed waits for the others' posts: the job's
    timeout (``process_group.job_timeout``), at most 5 s."""
    return min(job_timeout(), _ROLL_CALL_MOST)


class StepCollectiveFailed(RuntimeError):
    """A collective of the training step failed (timed out, or a peer's connection
    closed); the message names the ranks that did not answer the roll call."""

    def __init__(self, message: str, ranks: list[int], doing: str) -> None:
        super().__init__(message)
        self.ranks = ranks
        """Global ranks that did not answer (empty: every rank did)."""
        self.doing = doing
        """What this rank was doing when the collective failed."""


@dataclass
class Progress:
    """How far training over one of flatzero's groups got, for the roll call's posts."""

    steps: int = 0
    """Optimizer steps taken over the group (by every optimizer over it)."""


_progress: dict[int, tuple[Any, Progress]] = {}
"""``id(group)`` -> (the group, held so that its id stays its own; its progress)."""

_verdicts: dict[int, tuple[Any, StepCollectiveFailed]] = {}
"""``id(group)`` -> (the group that failed, held as in ``_progress``; its first verdict). By
the group itself, not its name: a group made anew after ``destroy_process_group`` gets
the old one's name."""


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _prefix() -> str:
    """The keys' prefix: one per torchrun run and restart (the agent's store outlives a
    restart's workers)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"flatzero/roll-call/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _process_key(rank: int) -> str:
    return f"{_prefix()}process/{rank}"


def _machine() -> str:
    """This machine's boot and pid namespace (pids mean the same only where both match);
    empty where unknown, or where ``/proc`` is another pid namespace's (``unshare --pid``
    without ``--mount-proc``: ``/proc/<pid>`` would be some other process)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        if int(Path("/proc/self/stat").read_text().split()[0]) != os.getpid():
            return ""
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except (OSError, ValueError):
        return ""


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None
    when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _this_process() -> dict[str, Any]:
    pid = os.getpid()
    fields = _stat(pid)
    start = int(fields[19]) if fields is not None and len(fields) > 19 else -1
    return {"host": socket.gethostname(), "machine": _machine(), "pid": pid, "start": start}


def progress_of(group: dist.ProcessGroup | None) -> Progress:
    """The ``Progress`` of training over flatzero's group ``group`` (one per group). The
    first call for a group over several ranks records this process (host, pid) in the
    store, for a roll call to tell a stopped or dead process on this machine."""
    entry = _progress.get(id(group))
    if entry is not None and entry[0] is group:
        return entry[1]
    progress = Progress()
    _progress[id(group)] = (group, progress)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        _store().set(_process_key(dist.get_rank()), json.dumps(_this_process()))
    return progress


def _group_name(group: dist.ProcessGroup | None) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return (lines[0] if lines else type(error).__name__)[:_ERROR_CHARS]


def raise_naming_ranks(
    error: BaseException, group: dist.ProcessGroup | None, doing: str
) -> NoReturn:
    """Raise ``StepCollectiveFailed`` for ``error``, raised by a collective of the step on
    ``group`` while this rank was ``doing`` something ("reducing gradients during
    backward"), naming the ranks that did not answer the roll call (see the module's
    docstring). ``error`` itself when it is one already.

    Call it only with an error raised by a collective or its wait: every rank whose
    collective failed takes part, and a rank that did not is named.
    """
    if isinstance(error, StepCollectiveFailed):
        raise error
    name = _group_name(group)
    failed = group if group is not None else dist.group.WORLD
    held = _verdicts.get(id(failed))
    earlier = held[1] if held is not None and held[0] is failed else None
    if earlier is not None:
        raise StepCollectiveFailed(
            f"flatzero: {doing} failed on rank {dist.get_rank()}: this group of flatzero's "
            f"collectives failed before: {earlier}",
            earlier.ranks,
            doing,
        ) from error
    entry = _progress.get(id(group))
    steps = entry[1].steps if entry is not None and entry[0] is group else 0
    post = {"steps": steps, "doing": doing, "error": _first_line(error)}
    if isinstance(error, _OWN_ERRORS):
        _bounded(lambda: _post(group, name, post))
        raise error
    verdict = _bounded_roll_call(group, name, post)
    _verdicts[id(failed)] = (failed, verdict)
    raise verdict from error


def _bounded_roll_call(
    group: dist.ProcessGroup | None, name: str, post: dict[str, Any]
) -> StepCollectiveFailed:
    """``_roll_call`` in a thread of its own, given up ``_STORE_GRACE_S`` after its timeout:
    a store whose host is stopped blocks even the clone's connection, whatever its timeout."""
    found = _bounded(lambda: _roll_call(group, name, post))
    most = roll_call_timeout().total_seconds() + _STORE_GRACE_S
    if found and isinstance(found[0], StepCollectiveFailed):
        return found[0]
    why = _first_line(found[0]) if found else f"no answer within {most:g} s"
    doing = str(post["doing"])
    return StepCollectiveFailed(
        f"flatzero: a collective of the training step failed on rank {dist.get_rank()} while "
        f"{doing}, after {plural(int(post['steps']), 'optimizer step')}, and the other ranks "
        f"could not be asked why: the c10d store did not answer ({why}; where a rank's "
        "process hosts the store, as rank 0 does without torchrun's agent, that rank may be "
        f"the one stopped). The collective's error: {post['error']}",
        [],
        doing,
    )


def _bounded(call: Callable[[], Any]) -> list[Any]:
    """``call()``'s result (or the store's error) in a list, from a thread of its own given
    up ``_STORE_GRACE_S`` after the roll call's timeout (empty then)."""
    found: list[Any] = []

    def run() -> None:
        try:
            found.append(call())
        except Exception as store_error:  # the store did not answer (DistStoreError)
            found.append(store_error)

    thread = threading.Thread(target=run, name="flatzero roll call", daemon=True)
    thread.start()
    thread.join(roll_call_timeout().total_seconds() + _STORE_GRACE_S)
    return found


def _roll_store() -> dist.Store:
    """A clone of the store whose every operation times out after the roll call's."""
    store = _store().clone()
    store.set_timeout(roll_call_timeout())
    return store


def _post(group: dist.ProcessGroup | None, name: str, post: dict[str, Any]) -> None:
    """Post this rank's answer to the roll call on ``group`` without waiting for others'."""
    me = dist.get_rank(group)
    _roll_store().set(f"{_prefix()}{name}/{me}", json.dumps(post))


@dataclass(frozen=True)
class _Roll:
    """What one rank's roll call found (ranks are the group's)."""

    posts: dict[int, dict[str, Any]]
    """The posts of the ranks that answered, this rank's included."""
    missing: dict[int, str]
    """What is known of each rank that did not answer (see ``_describe``)."""
    waited: float
    """Seconds waited for posts."""


def _roll_call(
    group: dist.ProcessGroup | None, name: str, post: dict[str, Any]
) -> StepCollectiveFailed:
    """Post ``post``, collect the others' posts, and make this rank's verdict."""
    wait = roll_call_timeout()
    store = _roll_store()
    size = dist.get_world_size(group)
    me = dist.get_rank(group)
    peers = [dist.get_global_rank(group, r) if group is not None else r for r in range(size)]
    keys = [f"{_prefix()}{name}/{r}" for r in range(size)]
    store.set(keys[me], json.dumps(post))
    posts: dict[int, dict[str, Any]] = {me: post}
    records: dict[int, dict[str, Any] | None] = {}
    start = time.monotonic()
    while True:
        for r in range(size):
            if r not in posts and store.check([keys[r]]):
                posts[r] = json.loads(store.get(keys[r]))
        missing = [r for r in range(size) if r not in posts]
        for r in missing:
            if r not in records:
                records[r] = _record(store, peers[r])
        states = {r: _state_of(records[r]) for r in missing}
        settled = all(s in ("stopped", "dead") for s in states.values())
        if settled or time.monotonic() - start >= wait.total_seconds():
            break
        time.sleep(_POLL_S)
    described = {r: _describe(peers[r], states[r], records[r]) for r in missing}
    roll = _Roll(posts, described, time.monotonic() - start)
    return _verdict(roll, peers, me, post)


def _record(store: dist.Store, rank: int) -> dict[str, Any] | None:
    """The process record of global rank ``rank`` (``progress_of``), if it wrote one."""
    key = _process_key(rank)
    if not store.check([key]):
        return None
    return json.loads(store.get(key))


def _state_of(record: dict[str, Any] | None) -> str | None:
    """``"dead"``, ``"stopped"`` or ``"running"`` for a process on this machine; None for
    one elsewhere (or unknown)."""
    if record is None or not record.get("machine") or record["machine"] != _machine():
        return None
    fields = _stat(int(record["pid"]))
    if fields is None or len(fields) < 20 or int(fields[19]) != record["start"]:
        return "dead"  # gone, or its pid reused
    if fields[0] in ("Z", "X", "x"):
        return "dead"
    return "stopped" if fields[0] in ("T", "t") else "running"


def _describe(rank: int, state: str | None, record: dict[str, Any] | None) -> str:
    """What is known of global rank ``rank``, which did not answer, from its process's
    ``state`` (``_state_of``)."""
    late = f"rank {rank} did not respond within {job_timeout().total_seconds():g} s"
    if state is None or record is None:
        where = f" on {record['host']}" if record is not None else ""
        return f"{late} (stopped, hung or dead{where}?)"
    process = f"its process (pid {record['pid']} on this machine)"
    return {
        "stopped": f"{late}: {process} is stopped (SIGSTOP, SIGTSTP or a debugger)",
        "dead": f"rank {rank} is dead: {process} is gone (killed?)",
        "running": f"{late}: {process} runs, but not in this collective (busy or hung)",
    }[state]


def _answers(posts: dict[int, dict[str, Any]], peers: list[int]) -> str:
    """The answers, grouped by what the ranks were doing."""
    by_doing: dict[tuple[int, str], list[int]] = {}
    for r, p in sorted(posts.items()):
        by_doing.setdefault((int(p["steps"]), str(p["doing"])), []).append(peers[r])
    return "; ".join(
        f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}: {doing}, "
        f"after {plural(steps, 'optimizer step')}"
        for (steps, doing), ranks in by_doing.items()
    )


def _verdict(roll: _Roll, peers: list[int], me: int, post: dict[str, Any]) -> StepCollectiveFailed:
    """This rank's error from its roll call."""
    seconds = job_timeout().total_seconds()
    head = (
        f"flatzero: a collective of the training step failed on rank {peers[me]} while "
        f"{post['doing']}, after {plural(int(post['steps']), 'optimizer step')}"
    )
    timeouts = (
        f"The collectives' timeout is the job's: {seconds:g} s (FLATZERO_TIMEOUT seconds, "
        "else DEEPSPEED_TIMEOUT minutes, else 30 minutes); the ranks then waited up to "
        f"{roll_call_timeout().total_seconds():g} s for each other in the c10d store "
        f"({roll.waited:.2f} s). The collective's error: {post['error']}"
    )
    if not roll.missing:
        others = "; ".join(
            f"rank {peers[r]}: {p['error']}" for r, p in sorted(roll.posts.items()) if r != me
        )
        return StepCollectiveFailed(
            f"{head}, and every rank of the group answered flatzero's roll call "
            f"({_answers(roll.posts, peers)}); their errors: {others}. {timeouts}",
            [],
            str(post["doing"]),
        )
    return StepCollectiveFailed(
        f"{head}: {'; '.join(roll.missing.values())}. Answered the roll call: "
        f"{_answers(roll.posts, peers)}. {timeouts}",
        [peers[r] for r in roll.missing],
        str(post["doing"]),
    )
