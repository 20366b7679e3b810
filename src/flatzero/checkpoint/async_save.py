"""Asynchronous saves: a snapshot in reusable host memory, a background writer, a wait.

``save_checkpoint(..., asynchronous=True)`` copies what the rank writes into one host
buffer per optimizer (``snapshot``: page-locked where an accelerator is present, so device
shards come over by DMA; allocated at the first asynchronous save, kept and reused by the
next ones, grown when the state grows) and returns; a background thread per rank writes
and fsyncs the rank file from the snapshot. The ranks then meet through the file system,
not a process group (a collective from a second thread would interleave with training's
collectives): each rank leaves a small mark in the checkpoint's temporary directory with
its file record or its error (``mark``), and rank 0's thread waits for every mark
(``collect_marks``) and publishes as a synchronous save does. The checkpoint appears, and
``latest`` moves, only once every rank's file is complete: a kill during the background
write leaves the previous checkpoint as it was.

The next ``save_checkpoint``, ``load_checkpoint`` or ``engine.destroy()`` first waits for
the previous save (``wait_for_save``): every rank joins its thread, then the ranks agree
(one all-reduce on the control group), so an error in any rank's background write, or in
rank 0's publishing, is raised there on every rank. A process that exits without waiting
finishes the write first (the thread is not a daemon).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import accel
from ..control import raise_if_any_failed
from ..hostmem import StagingBuffer, staging_buffer
from .format import FileRecord

__all__ = [
    "collect_marks",
    "mark",
    "release_snapshot",
    "snapshot",
    "start",
    "wait_for_save",
]

logger = logging.getLogger(__name__)

_ALIGN = 64
"""Bytes each tensor of a snapshot is aligned to in the buffer."""

_POLL_S = 0.02
"""Seconds between rank 0's looks for the other ranks' marks."""


@dataclasses.dataclass
class _Pending:
    """A background save of one optimizer: its thread, what it saves, how it ended."""

    thread: threading.Thread
    path: Path
    group: Any
    error: BaseException | None = None


_snapshots: weakref.WeakKeyDictionary[Any, StagingBuffer] = weakref.WeakKeyDictionary()
_pending: weakref.WeakKeyDictionary[Any, _Pending] = weakref.WeakKeyDictionary()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def snapshot(
    optimizer: Any, tensors: Sequence[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    """Copies of ``tensors`` in ``optimizer``'s reusable host buffer (same names, dtypes
    and shapes; contiguous). Device tensors are copied without blocking into a page-locked
    buffer, then each device is synchronized once.

    Raises:
        RuntimeError: the buffer cannot be allocated (out of host memory).
    """
    nbytes = [t.numel() * t.element_size() for _, t in tensors]
    total = sum(_aligned(n) for n in nbytes)
    on_device = {t.device for _, t in tensors if accel.is_accelerator(t.device)}
    buffer = _snapshots.get(optimizer)
    if buffer is None or buffer.data.numel() < total or (on_device and not buffer.pinned):
        release_snapshot(optimizer)
        buffer = staging_buffer(max(1, total), pin=bool(on_device))
        _snapshots[optimizer] = buffer
    out = []
    offset = 0
    for (name, tensor), n in zip(tensors, nbytes, strict=True):
        view = buffer.data[offset : offset + n].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor.detach(), non_blocking=buffer.pinned)
        out.append((name, view))
        offset += _aligned(n)
    for device in on_device:
        accel.synchronize(device)
    return out


def release_snapshot(optimizer: Any) -> None:
    """Free ``optimizer``'s snapshot buffer (the next asynchronous save allocates anew).
    Call it only while no save of it is pending."""
    buffer = _snapshots.pop(optimizer, None)
    if buffer is not None:
        buffer.release()


def start(optimizer: Any, job: Callable[[], None], path: Path, group: Any) -> None:
    """Run ``job`` (the write and publish of the checkpoint at ``path``) in a background
    thread; ``wait_for_save(optimizer)`` joins it."""

    def run() -> None:
        try:
            job()
        except BaseException as error:
            pending.error = error
            logger.error("asynchronous save of %s failed: %s", path, error)

    thread = threading.Thread(target=run, name=f"flatzero-save-{path.name}", daemon=False)
    pending = _Pending(thread, path, group)
    _pending[optimizer] = pending
    thread.start()


def wait_for_save(optimizer: Any) -> None:
    """Wait for ``optimizer``'s asynchronous save, if any; raise its error on every rank.

    Collective over the optimizer's process group when a save is pending (every rank has
    one then: they started it together); nothing otherwise.

    Raises:
        The background error on the rank it happened on; ``RuntimeError`` on the others.
    """
    pending = _pending.pop(optimizer, None)
    if pending is None:
        return
    t0 = time.perf_counter()
    pending.thread.join()
    waited = time.perf_counter() - t0
    if waited > 0.1:
        logger.info("waited %.2f s for the asynchronous save of %s", waited, pending.path)
    raise_if_any_failed(
        pending.error,
        pending.group,
        f"the asynchronous save of {pending.path} failed on another rank (see its error); "
        "it was not published",
    )


def _mark_path(tmp: Path, rank: int) -> Path:
    return tmp / f".mark-{rank:05d}.json"


def mark(tmp: Path, rank: int, record: FileRecord | None, error: BaseException | None) -> None:
    """Leave rank ``rank``'s mark in ``tmp``: its file record, or its error (written to a
    temporary name and renamed, so rank 0 never reads half a mark)."""
    data = (
        {"error": f"{type(error).__name__}: {error}"}
        if error is not None
        else {"record": dataclasses.asdict(record)}
    )
    path = _mark_path(tmp, rank)
    part = path.with_suffix(".part")
    part.write_text(json.dumps(data), encoding="utf-8")
    os.replace(part, path)


def collect_marks(tmp: Path, world_size: int, timeout_s: float) -> list[FileRecord]:
    """Every rank's file record, in rank order, once every rank has left its mark in
    ``tmp`` (removing the marks).

    Raises:
        RuntimeError: a rank's mark holds an error (naming the rank and the error), or not
            every rank left one within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    paths = [_mark_path(tmp, r) for r in range(world_size)]
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            missing = [r for r, p in enumerate(paths) if not p.exists()]
            raise RuntimeError(
                f"ranks {missing} did not finish writing into {tmp} within {timeout_s:.0f} s"
            )
        time.sleep(_POLL_S)
    marks = [json.loads(p.read_text(encoding="utf-8")) for p in paths]
    for rank, data in enumerate(marks):
        if "error" in data:
            raise RuntimeError(f"rank {rank} failed to write its file into {tmp}: {data['error']}")
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    return [FileRecord(**data["record"]) for data in marks]
