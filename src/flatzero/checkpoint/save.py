"""``save_checkpoint``: every rank writes its own shard file; the directory appears complete.

One ``Save`` object holds a save's state from start to end: the root, the agreed tag, the
temporary directory (``atomic.StagedDirectory``), what was collected (``collect``), and
for an asynchronous save its snapshot and background thread (the optimizer's
``checkpointer.Checkpointer`` keeps the thread until the next save, load or
``wait_for_save`` waits for it). The steps: [Note: the save protocol].
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..comm import world_size_of
from ..control import every_rank_or_none, host_work_timeout
from ..flatten import FlatParams
from ..optim import ZeroOptimizer
from ..own_groups import control_group
from ..progress import progress_bar
from ..storage.image import FileImage
from .async_save import Hasher, Staging, snapshot
from .atomic import (
    StagedDirectory,
    fault_point,
    point_latest,
    remove_in_background,
)
from .begin import agree_tag, create_tmp
from .checkpointer import BackgroundSave, checkpointer_of, wait_for_save
from .collect import Collected, RankFiles, collect, rank_files
from .config import SaveConfig
from .format import (
    MODEL_REST,
    CheckpointMeta,
    FileRecord,
    available_tags,
    rank_file_name,
    read_latest,
)
from .reports import SaveReports
from .writer import (
    rank_file_metadata,
    write_image_file,
    write_rank_file,
    write_tensors,
)

__all__ = ["Save", "save_checkpoint"]

logger = logging.getLogger(__name__)


def _every_rank_or_none(
    group: dist.ProcessGroup | None,
    what: str,
    catch: tuple[type[BaseException], ...],
    wait_bytes: int | None = None,
) -> every_rank_or_none:
    """A save's step that raises on every rank if it failed on any (on the control group)."""
    return every_rank_or_none(
        group,
        f"saving the checkpoint failed on another rank while {what} (see its error)",
        catch=catch,
        wait_bytes=wait_bytes,
    )


def _naming_rank(error: Exception, rank: int, writing: Path) -> Exception:
    """``error`` of a background write of the file ``writing``, as every rank learns it: an
    ``OSError`` becomes one of the same kind and number whose message names ``rank`` and
    the file (its own, else ``writing``); other errors (bugs) stay as they are."""
    if not isinstance(error, OSError):
        return error
    if error.errno is None:
        named = OSError(f"rank {rank}: {error}")
    else:  # OSError(errno, ...) is of errno's subclass (PermissionError, ...)
        named = OSError(
            error.errno, f"rank {rank}: {error.strerror}", error.filename or str(writing)
        )
    named.__cause__ = error
    return named


def _prune(root: Path, keep_last: int, keep: set[str]) -> None:
    """Remove the oldest complete checkpoints so that ``keep_last`` remain."""
    tags = sorted(available_tags(root), key=lambda t: (root / t / "meta.json").stat().st_mtime)
    for tag in tags[: max(0, len(tags) - keep_last)]:
        if tag in keep:
            continue
        remove_in_background(root / tag)  # disappears as a whole, then is deleted
        logger.info("removed old checkpoint %s", root / tag)


# [Note: the save protocol]
# Collective; every rank of the optimizer's process group calls it:
# 1. The ranks agree on the tag and on rank 0's random nonce.
# 2. Rank 0 creates ``DIR/.tmp-<tag>-<nonce>/`` (first putting back a tag that a save
#    killed while replacing it lost, see ``recovery``, and removing stale ``.tmp-*`` left
#    by killed saves). All ranks learn whether that worked.
# 3. Every rank writes and fsyncs its rank file there (its master and optimizer-state
#    shards, optionally its RNG states); rank 0 also writes the model's frozen params and
#    buffers when a model is given. Nothing is gathered: each rank writes its own shard.
# 4. Rank 0 collects the small file records, writes ``meta.json``, fsyncs, renames the
#    directory to ``DIR/<tag>/`` (exchanges it with an existing one, ``atomic.publish``)
#    and then points ``DIR/latest`` at it.
# An error on any rank makes every rank raise and rank 0 remove the temporary directory
# (``every_rank_or_none``); a process killed mid-save leaves only the ``.tmp-*``
# directory, which loaders ignore. With ``asynchronous=True``, steps 3 and 4 run in a
# background thread of every rank from a copy of the rank's tensors in host memory, and
# the ranks meet through reports in the c10d store instead of collectives
# (``reports``): a rank whose write failed removes its partial files, and rank 0 removes
# the temporary directory as soon as any rank reports an error. Every agreement runs on
# the process group's control group (gloo, never queued behind GPU work or the NCCL
# watchdog); where ranks wait for writing, they first meet in ``wait_for_host_work`` with
# a timeout that fits the bytes written.


class Save:
    """One save of one optimizer, from the agreed tag to the published checkpoint.

    Made by ``begin`` (collective: the ranks agree on the tag, rank 0 creates the
    temporary directory), then either ``write`` (synchronous) or ``start`` (asynchronous).

    Attributes:
        optimizer: the optimizer saved.
        root: the checkpoint directory.
        tag: the tag every rank agreed on.
        staged: the temporary directory and where it appears, ``root/tag``.
        collected: what is saved (``collect``).
        files: what this rank writes (``collect.rank_files``).
        config: how.
        images: an asynchronous save's snapshot, its files laid out in host memory.
        staging: the copies into the snapshot still to land.
        background: an asynchronous save's thread (None: synchronous, or not started).
        writing: the file its background thread writes (``tmp`` before the first), named
            by an error without a file name of its own (``os.write``'s ENOSPC).
        nonce: the save's nonce (rank 0's), in ``meta.json`` and every file's header.
        run_id: the job's run id (rank 0's, ``run_id``), in ``meta.json``.
    """

    def __init__(
        self,
        optimizer: ZeroOptimizer,
        root: Path,
        staged: StagedDirectory,
        collected: Collected,
        files: RankFiles,
        config: SaveConfig,
        ids: tuple[str, str],
    ) -> None:
        self.optimizer = optimizer
        self.nonce, self.run_id = ids
        self.root = root
        self.tag = staged.final.name
        self.staged = staged
        self.collected = collected
        self.config = config
        self.files = files
        self.images: list[FileImage] = []
        self.staging: Staging | None = None
        self.background: BackgroundSave | None = None
        self.writing = staged.tmp

    @property
    def flat(self) -> FlatParams:
        """The optimizer's flat params (layout, ranks, process group)."""
        return self.optimizer.flat

    @property
    def tmp(self) -> Path:
        """The temporary directory every rank writes into."""
        return self.staged.tmp

    @classmethod
    def begin(
        cls,
        optimizer: ZeroOptimizer,
        root: Path,
        tag: str | None,
        *,
        scheduler: Any,
        model: torch.nn.Module | None,
        extra: Any,
        config: SaveConfig,
    ) -> Save:
        """Collect what is saved, agree on the tag and create the temporary directory
        (collective; every rank raises if any rank failed)."""
        group = optimizer.flat.process_group
        with _every_rank_or_none(group, "collecting the state to save", (ValueError, TypeError)):
            collected = collect(optimizer, tag, scheduler, model, extra)
        agreed, nonce, run = agree_tag(collected.tag, group)
        staged = StagedDirectory.beside(root / agreed, nonce)
        create_tmp(staged, optimizer.flat, config, run)
        files = rank_files(collected, optimizer.flat, config)
        if model is not None:  # its frozen params: snapshot like the shards (issue 41, 9)
            names = frozenset(n for n, _ in model.named_parameters(remove_duplicate=False))
            files = dataclasses.replace(files, frozen=names)
        return cls(optimizer, root, staged, collected, files, config, (nonce, run))

    # ------------------------------------------------------------------ synchronous
    def _write_files(self) -> tuple[FileRecord, FileRecord | None]:
        """Write this rank's file (and, on rank 0, the model's rest) into ``tmp``; their
        records."""
        flat, config = self.flat, self.config
        total = sum(
            t.numel() * t.element_size() for _n, t in (*self.files.tensors, *self.files.rest)
        )
        bar = progress_bar(total, "flatzero save (rank 0)", "B", rank=flat.rank, scale=True)
        with bar:
            record = write_rank_file(
                self.tmp,
                flat.rank,
                flat.world_size,
                self.files.tensors,
                layout_digest=flat.layout.digest(),
                tag=self.tag,
                metadata=self.files.metadata,
                checksums=config.checksums,
                progress=bar,
                nonce=self.nonce,
            )
            rest_record = None
            if self.files.rest:
                rest_record = write_tensors(  # device tensors stream through two host chunks
                    self.tmp / MODEL_REST,
                    self.files.rest,
                    {"format": "pt", "tag": self.tag, "nonce": self.nonce},
                    checksums=config.checksums,
                    progress=bar,
                )
        return record, rest_record

    def _write_everywhere(self) -> tuple[list[FileRecord], FileRecord | None]:
        """Every rank writes its files and all agree that they did; returns every rank's
        file record (in rank order) and the model rest's. On any failure rank 0 removes
        ``tmp``."""
        flat = self.flat
        group = flat.process_group
        try:
            # Allow for the most any rank writes: rank 0 its shards (every rank's are the
            # same size) and the model's rest.
            with _every_rank_or_none(
                group,
                f"writing its rank file into {self.tmp}",
                (OSError, ValueError, TypeError),
                wait_bytes=self.collected.written_at_most(),
            ):
                record, rest_record = self._write_files()
        except BaseException:
            if flat.rank == 0:
                self.staged.discard()
            raise
        if world_size_of(group) == 1:
            return [record], rest_record
        records: list[Any] = [None] * flat.world_size
        dist.all_gather_object(records, record, group=control_group(group))
        return records, rest_record

    def _publish_here(self, meta: CheckpointMeta) -> None:
        """(Rank 0.) Write ``meta.json``, make ``tmp`` appear as ``root/<tag>``, point
        ``latest`` at it and prune old checkpoints; on failure remove ``tmp`` and raise."""
        root, config = self.root, self.config
        try:
            meta.write(self.tmp / "meta.json")
            fault_point("before_publish", 0)
            self.staged.publish(overwrite=config.overwrite)
            fault_point("before_latest", 0)
            if config.update_latest:
                point_latest(root, meta.tag)
            if config.keep_last is not None:
                keep = {meta.tag}
                with contextlib.suppress(ValueError):
                    keep.add(read_latest(root))
                _prune(root, config.keep_last, keep)
        except BaseException:
            self.staged.discard()
            raise

    def _publish(self, meta: CheckpointMeta) -> None:
        """Rank 0 publishes (``_publish_here``); every rank learns whether that worked."""
        # wait_bytes=0: the others wait while rank 0 writes meta.json, renames and prunes
        with _every_rank_or_none(
            self.flat.process_group,
            f"publishing {self.root / meta.tag}",
            (OSError, ValueError, TypeError),
            wait_bytes=0,
        ):
            if self.flat.rank == 0:
                self._publish_here(meta)

    def _meta(self, records: list[FileRecord], rest_record: FileRecord | None) -> CheckpointMeta:
        """The checkpoint's ``meta.json``, with the save's nonce and run id."""
        meta = self.collected.meta(self.tag, records, rest_record, self.flat, self.config)
        return dataclasses.replace(meta, nonce=self.nonce, run_id=self.run_id)

    def write(self) -> list[FileRecord]:
        """Write every rank's files and publish (collective); every rank's file record."""
        records, rest_record = self._write_everywhere()
        self._publish(self._meta(records, rest_record))
        return records

    # ----------------------------------------------------------------- asynchronous
    def _write_images(self, hasher: Hasher) -> tuple[FileRecord, FileRecord | None]:
        """Write this rank's snapshot (its rank file, on rank 0 also the model's rest) into
        ``tmp``; their records, with the checksums ``hasher`` computes meanwhile."""
        images, rank = self.images, self.flat.rank
        self.writing = self.tmp / images[0].name
        record = write_image_file(self.tmp, images[0], sums=lambda: hasher.sums(0), rank=rank)
        fault_point("rank_file_written", rank)
        rest_record = None
        if len(images) > 1:
            self.writing = self.tmp / images[1].name
            rest_record = write_image_file(self.tmp, images[1], sums=lambda: hasher.sums(1))
        return record, rest_record

    def _write_in_background(self, reports: SaveReports) -> None:
        """(A background thread of every rank, at the caller's priority.) Once the snapshot
        is complete (its host chunks copied by an idle-priority ``Hasher`` or by the next
        step's fence), write this rank's files from it, take the hasher's checksums and
        report (``reports``: through the c10d store, never the checkpoint's directory); a
        rank whose write failed first removes its partial files. Rank 0 then waits for
        every rank's report and publishes, or removes ``tmp`` as soon as any rank reports
        an error. Raises this rank's error (naming the rank), or on rank 0 any rank's."""
        flat, staging = self.flat, self.staging
        assert staging is not None
        error: BaseException | None = None
        record = rest_record = None
        hasher: Hasher | None = None
        try:
            hasher = Hasher(self.images, staging, self.config.checksums, flat.rank)
            staging.landed.wait()
            staging.wait_device_copies()
            record, rest_record = self._write_images(hasher)
        except Exception as e:  # every rank reports, or rank 0 waits for it in vain
            self._remove_partial_files()
            if flat.rank != 0 and reports.abandoned():  # tmp removed after another's error
                logger.info("rank %d stopped writing %s: %s", flat.rank, self.tmp, e)
            else:
                error = _naming_rank(e, flat.rank, self.writing)
        if hasher is not None:
            hasher.join()
        reports.post(flat.rank, record, error)
        if flat.rank == 0:
            try:
                self._collect_and_publish(reports, rest_record)
            except BaseException as e:
                reports.post_outcome(error or e)  # for ranks exiting meanwhile (``exit``)
                if error is None:
                    raise
            else:
                reports.post_outcome(None)
        if error is not None:
            raise error  # its own error first (on rank 0 too), as on the other ranks

    def _collect_and_publish(self, reports: SaveReports, rest_record: FileRecord | None) -> None:
        """(Rank 0's background thread.) Wait for every rank's report, then publish; on any
        rank's error remove ``tmp`` and raise."""
        given_up = self.background.given_up if self.background is not None else None
        try:
            records = reports.collect(
                self.tmp, self._timeout_s(), failed=self.staged.discard, given_up=given_up
            )
        except BaseException:
            self.staged.discard()  # again: a rank may have created a file meanwhile
            raise
        self._publish_here(self._meta(records, rest_record))
        logger.info("saved checkpoint %s in the background", self.root / self.tag)

    def _timeout_s(self) -> float:
        """Seconds the ranks' writes may take (the most any rank writes, slowest disk)."""
        return host_work_timeout(self.collected.written_at_most()).total_seconds()

    def _remove_partial_files(self) -> None:
        """(A rank whose background write failed.) Remove what it wrote of its files, so
        that a full disk has room again at once (rank 0 removes ``tmp`` too)."""
        for image in self.images:
            with contextlib.suppress(OSError):
                (self.tmp / image.name).unlink()

    def _wanted(self) -> list[tuple[str, list[tuple[str, torch.Tensor]], dict[str, str]]]:
        """The files of this rank's snapshot: its rank file, on rank 0 the model's rest."""
        flat, files = self.flat, self.files
        meta = rank_file_metadata(
            flat.rank, flat.world_size, flat.layout.digest(), self.tag, files.metadata, self.nonce
        )
        wanted = [(rank_file_name(flat.rank, flat.world_size), files.tensors, meta)]
        if files.rest:
            wanted.append(
                (MODEL_REST, files.rest, {"format": "pt", "tag": self.tag, "nonce": self.nonce})
            )
        return wanted

    def start(self) -> None:
        """Lay this rank's files out in host memory and start copying them there (every
        rank agrees it could; rank 0 removes ``tmp`` if not), then finish the copies, write
        and publish in a background thread. The rank file's tensors (master and state
        shards) and the model's frozen params are held by the optimizer's next step or load
        until copied (``Staging``); the model's buffers (a forward pass may change them)
        are copied before this returns (on an accelerator: the device's next work is
        queued after their copy)."""
        flat = self.flat
        checkpointer = checkpointer_of(self.optimizer)
        wanted = self._wanted()
        try:
            with _every_rank_or_none(
                flat.process_group,
                f"copying its shards into host memory for {self.tmp}",
                (RuntimeError, OSError),  # out of host memory
            ):
                self.images, self.staging = snapshot(
                    checkpointer, wanted, deferrable=[True, self.files.frozen][: len(wanted)]
                )
            staging = self.staging
            assert staging is not None
            fault_point("snapshot_taken", flat.rank)
            reports = SaveReports(self.tmp.name, flat.process_group, flat.world_size)
            self.background = checkpointer.start(
                lambda: self._write_in_background(reports),
                self.staged.final,
                flat.process_group,
                timeout_s=self._timeout_s(),
                outcome=functools.partial(reports.settle, flat.rank),
                forget=reports.forget_outcome if flat.rank == 0 else None,
                nbytes=self.collected.written_at_most(),
            )
        except BaseException:
            if self.staging is not None:  # no device copy may still write the reused buffer
                self.staging.wait_device_copies()
            if flat.rank == 0:
                self.staged.discard()
            raise
        flat.hold_state_until(staging.fence)


def save_checkpoint(
    directory: str | Path,
    optimizer: ZeroOptimizer,
    tag: str | None = None,
    *,
    scheduler: Any = None,
    model: torch.nn.Module | None = None,
    extra: Any = None,
    config: SaveConfig | None = None,
    asynchronous: bool = False,
) -> Path:
    """Save a ZeRO checkpoint: each rank writes its shard; loadable at any world size.

    Collective: call on every rank of the optimizer's process group with the same
    ``directory`` (on a file system every rank sees) and ``tag``. A previous asynchronous
    save of the optimizer is waited for first (its error raised here on every rank).

    Args:
        directory: the checkpoint directory (created if needed); the checkpoint goes to
            ``directory/tag`` and ``directory/latest`` names it.
        optimizer: a ``ZeroOptimizer`` (``flat``, ``sharded_state()``).
        tag: the checkpoint's name; default ``step<N>`` from the optimizer's step count.
        scheduler: an LR scheduler (or anything with a JSON-able ``state_dict()``).
        model: the model; its frozen params and persistent buffers are saved too (from
            rank 0), and its param names and tied aliases are recorded for export.
        extra: JSON-able client state (e.g. ``{"epoch": 3, "samples": 12800}``) returned
            by ``load_checkpoint``.
        config: ``SaveConfig`` (RNG states, checksums, overwrite, keep_last, ...).
        asynchronous: lay this rank's files out in reusable host memory, start copying
            its shards there and return; a background thread finishes the copies, writes
            and publishes (``async_save``; the next optimizer step waits for the copies
            only). The checkpoint appears once every rank's file is complete; the next
            save, load or ``wait_for_save`` waits for it.

    Returns:
        The path of the new checkpoint, ``directory/tag`` (after an asynchronous save:
        where it will appear).

    Raises:
        ValueError: the tag exists (without ``overwrite``), tags differ between ranks, or
            a state cannot be stored (named); nothing is published.
        OSError: writing failed on some rank; nothing is published.
    """
    config = config or SaveConfig()
    t0 = time.perf_counter()
    control_group(
        optimizer.flat.process_group
    )  # created (collective) now, not while some rank writes
    wait_for_save(optimizer)
    save = Save.begin(
        optimizer,
        Path(directory),
        tag,
        scheduler=scheduler,
        model=model,
        extra=extra,
        config=config,
    )
    if asynchronous:
        save.start()
        return save.staged.final
    records = save.write()
    if save.flat.rank == 0:
        logger.info(
            "saved checkpoint %s: %d rank files, %.1f MiB, %.2f s",
            save.staged.final,
            save.flat.world_size,
            sum(r.bytes for r in records) / 2**20,
            time.perf_counter() - t0,
        )
    return save.staged.final
