"""What the engine's ranks must agree on before they enter collectives that depend on it.

A rank that decides alone (its config, whether a checkpoint exists, where it writes) and
takes another path than the others leaves them waiting in a collective it never calls: a
gloo abort or an NCCL hang. Each function here asks every rank first, on the control
group (gloo, never queued behind GPU work), and gives every rank the same answer or the
same error.

- ``agree_on_config``: everything that shapes the collective schedule (accumulation steps,
  stage, bucket sizes, clipping, precision, reduce dtype, optimizer, scheduler, ...);
- ``agree_on_checkpoint_to_load``: whether ``load_dir/latest`` exists, on every rank;
- ``check_shared_directory``: that a checkpoint directory is one shared path (rank 0
  writes a marker, every other rank must see it);
- ``user_errors_agreed``: a user error found on one rank (its optimizer, param groups,
  scheduler, arguments) raised on every rank before the collective that would wait for it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ...comm import all_reduce_max_each, check_same_everywhere, rank_of, world_size_of
from ...control import ErrorFactory, Failures, every_rank_or_none
from ...own_groups import control_group
from .errors import UnsupportedFeatureError

if TYPE_CHECKING:
    from .config import EngineConfig

__all__ = [
    "agree_on_checkpoint_to_load",
    "agree_on_config",
    "check_shared_directory",
    "user_errors_agreed",
]

_MARKER_PREFIX = ".flatzero-shared-check-"
_MARKER_WAIT_S = 5.0
"""How long a rank looks for rank 0's marker before it calls the directory not shared
(a network file system may show a new file a moment late)."""


def config_fields(cfg: EngineConfig) -> dict[str, str]:
    """The parsed config's settings that shape what every step, save and load runs: one
    text per section, its frozen dataclass's ``repr`` (numbers, flags, dtypes, names); the
    flatten settings as ``FlattenConfig.compared_text`` (each rank has its own device)."""
    sections = {
        "batch sizes and gradient_accumulation_steps": cfg.batch,
        "zero_optimization": cfg.zero,
        "bf16/fp16": cfg.precision,
        "flatten": cfg.flatten.compared_text(),  # device by type; progress dropped
        "ZeroOptimizer (buckets, clipping, reduce dtype)": cfg.zero_optimizer,
        "optimizer": cfg.optimizer,
        "scheduler": cfg.scheduler,
        "flatzero": cfg.flatzero,
        "dataloader_drop_last": cfg.dataloader_drop_last,
    }
    return {
        name: value if isinstance(value, str) else repr(value) for name, value in sections.items()
    }


def agree_on_config(cfg: EngineConfig, group: dist.ProcessGroup | None) -> None:
    """Raise ``ValueError`` on every rank when ranks parsed configs that would run different
    collectives (a rank with another ``gradient_accumulation_steps`` would otherwise abort
    gloo or hang NCCL at its first step). Collective."""
    check_same_everywhere(
        "the DeepSpeed config (every rank must pass the same one)",
        config_fields(cfg),
        control_group(group),
        fix="Pass the same config on every rank (and the same world size to parse it with)",
    )


def _same_kind(what: str) -> ErrorFactory:
    """Every rank's error once some rank found a user error: the failing rank raises its
    own; every other rank an error of the same kind (``UnsupportedFeatureError``, so that
    ``patch_deepspeed`` hands every rank to DeepSpeed alike; ``TypeError``; else
    ``ValueError``) whose message is ``what`` and the first failing rank's message."""

    def make(failures: Failures) -> BaseException:
        if failures.mine is not None:
            return failures.mine
        first, others = failures.first, len(failures.kinds) - 1
        text = f"{what} failed on rank {first.rank}" + (f" (and {others} more)" if others else "")
        text += f": {first.kind}: {first.message}"
        key, feature = first.fields.get("key"), first.fields.get("feature")
        if first.kind == UnsupportedFeatureError.__name__ and key and feature:
            return UnsupportedFeatureError(text, key=str(key), feature=str(feature))
        return (TypeError if first.kind == "TypeError" else ValueError)(text)

    return make


def user_errors_agreed(
    what: str,
    group: dist.ProcessGroup | None,
    catch: tuple[type[BaseException], ...] = (Exception,),
) -> every_rank_or_none:
    """A check of the user's input that raises on every rank if it failed on any, before a
    collective the failing rank would not join (``_same_kind`` says which error). One small
    all-reduce when no rank failed."""
    return every_rank_or_none(group, catch=catch, error_type=_same_kind(what))


def agree_on_checkpoint_to_load(
    load_dir: Path, tag: str | None, group: dist.ProcessGroup | None
) -> bool:
    """Whether there is a checkpoint to load: ``tag`` given, or ``load_dir/latest`` is a
    file; the same answer on every rank, or ``FileNotFoundError`` on every rank when ranks
    see it differently (a typo in one rank's path, or node-local disks). Collective.
    """
    latest = load_dir / "latest"
    found = tag is not None or latest.is_file()
    if world_size_of(group) == 1:
        return found
    high, neg_low = all_reduce_max_each([int(found), -int(found)], control_group(group))
    if high == -neg_low:
        return found
    seen: list[str] = [""] * world_size_of(group)
    mine = f"rank {rank_of(None)} " + (
        f"was given tag {tag!r}"
        if tag is not None
        else f"finds {str(latest)!r}"
        if found
        else f"does not find {str(latest)!r}"
    )
    dist.all_gather_object(seen, mine, group=control_group(group))
    raise FileNotFoundError(
        f"ranks disagree on whether there is a checkpoint to load ({'; '.join(seen)}): pass "
        "the same load_dir and tag on every rank, on a file system every rank shares (not "
        "a node-local disk)"
    )


def check_shared_directory(directory: Path, group: dist.ProcessGroup | None) -> None:
    """Raise on every rank unless ``directory`` is one directory every rank of ``group``
    sees and rank 0 can write: rank 0 creates it and writes a marker file, every other rank
    looks for the marker, rank 0 removes it. Collective.

    Raises:
        OSError: on every rank, with rank 0's errno, when rank 0 cannot create the
            directory or write into it (read-only, permission denied, full); nothing is
            left behind and every rank can go on.
        FileNotFoundError: on every rank, when another rank does not see rank 0's marker.
    """
    control = control_group(group)
    if world_size_of(group) == 1:
        return
    name = [_MARKER_PREFIX + uuid.uuid4().hex if rank_of(control) == 0 else ""]
    dist.broadcast_object_list(name, src=_global_rank0(control), group=control)
    marker = directory / name[0]
    written: list[Any] = [None]
    if rank_of(control) == 0:
        written[0] = _write_marker(directory, marker)
    # rank 0's outcome reaches every rank before anyone looks for the marker
    dist.broadcast_object_list(written, src=_global_rank0(control), group=control)
    if written[0] is not None:
        errno, reason = written[0]
        raise OSError(
            errno, f"cannot write the checkpoint into {str(directory)!r}: rank 0: {reason}"
        )
    error = ""
    if rank_of(control) != 0 and not _appears(marker):
        error = f"rank {rank_of(None)} does not see {str(marker)!r}"
    missing = all_reduce_max_each([int(bool(error))], control)[0]
    if rank_of(control) == 0:
        with contextlib.suppress(OSError):  # the check's own file: never the save's error
            marker.unlink(missing_ok=True)
    if missing:
        _raise_not_shared(directory, error, control)


def _raise_not_shared(directory: Path, error: str, control: dist.ProcessGroup | None) -> None:
    """The same ``FileNotFoundError`` on every rank, with every rank's finding."""
    errors: list[str] = [""] * world_size_of(control)
    dist.all_gather_object(errors, error, group=control)
    raise FileNotFoundError(
        "the checkpoint directory is not one directory shared by every rank "
        f"({'; '.join(e for e in errors if e)}): pass the same path on every rank, on a "
        "file system every rank shares (not a node-local disk)"
    )


def _global_rank0(control: dist.ProcessGroup | None) -> int:
    return 0 if control is None else dist.get_global_rank(control, 0)


def _write_marker(directory: Path, marker: Path) -> tuple[int, str] | None:
    """Create ``directory`` and ``marker`` in it; the OS's errno and what it said on
    failure (naming the directory, never the check's own file), else None."""
    if directory.exists() and not directory.is_dir():
        return errno.ENOTDIR, "it is a file, not a checkpoint directory"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        marker.write_bytes(b"")
    except OSError as error:
        code = error.errno or 0
        return code, os.strerror(code)
    return None


def _appears(marker: Path) -> bool:
    """Whether ``marker`` exists, looking again for up to ``_MARKER_WAIT_S`` seconds."""
    deadline = time.monotonic() + _MARKER_WAIT_S
    while not marker.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
