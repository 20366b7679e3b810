"""What a crash while replacing a tag leaves, and finding the good copy in it.

Replacing a tag without ``RENAME_EXCHANGE`` (``atomic.publish``'s fallback) has an instant
where ``DIR/<tag>`` does not exist: the old checkpoint is under
``.tmp-<tag>-replaced-<pid>`` and the new, complete one under ``.tmp-<tag>-<nonce>``. A tag
is *lost* when its directory has no ``meta.json`` although it was published: ``latest``
names it, or a ``-replaced-`` copy of it exists. Its good copy is then the newest complete
``.tmp-*`` directory whose ``meta.json`` says it is that tag. The loader loads that copy
(with a warning); the next save renames it back under its tag, and its stale-directory
cleanup never removes a complete copy of a lost tag. A save killed before it
published (a new tag no ``latest`` names) is not lost: it never existed, and its
directory is removed like any unfinished save.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from .atomic import REMOVING, REPLACED, fsync_dir
from .format import META, TMP_PREFIX, CheckpointMeta, read_latest

__all__ = ["complete_meta", "copy_of_lost", "lost_copy", "restore_lost", "saved_time"]

logger = logging.getLogger(__name__)


def complete_meta(path: Path) -> CheckpointMeta | None:
    """``path``'s metadata when it is a complete checkpoint (``meta.json`` parses, every
    file it records exists with the recorded size), else None. Reads no tensor data."""
    try:
        meta = CheckpointMeta.read(path / META)
        for record in meta.files:
            if (path / record.file).stat().st_size != record.bytes:
                return None
        if meta.model_rest is not None and not (path / meta.model_rest).is_file():
            return None
    except (ValueError, OSError):
        return None
    return meta


def saved_time(path: Path, meta: CheckpointMeta) -> float:
    """When the checkpoint at ``path`` was saved (seconds since the epoch): its recorded
    ``saved_at``, else the modification time of its ``meta.json``."""
    if meta.saved_at is not None:
        return float(meta.saved_at)
    return (path / META).stat().st_mtime


def _copies(root: Path) -> dict[str, list[tuple[float, Path]]]:
    """Complete checkpoints under ``.tmp-*`` names in ``root``, by the tag their
    ``meta.json`` names, newest first."""
    found: dict[str, list[tuple[float, Path]]] = {}
    with contextlib.suppress(OSError):
        for entry in root.iterdir():
            if not entry.name.startswith(TMP_PREFIX) or not entry.is_dir():
                continue
            if entry.name.startswith(REMOVING):  # being deleted: never a copy to restore
                continue
            meta = complete_meta(entry)
            if meta is not None:
                found.setdefault(meta.tag, []).append((saved_time(entry, meta), entry))
    for copies in found.values():
        copies.sort(key=lambda c: c[0], reverse=True)
    return found


def _latest(root: Path) -> str | None:
    try:
        return read_latest(root)
    except ValueError:
        return None


def _is_lost(root: Path, tag: str, copies: list[tuple[float, Path]]) -> bool:
    """Whether ``tag`` was published but its directory has no ``meta.json``."""
    if (root / tag / META).is_file():
        return False
    replaced = f"{TMP_PREFIX}{tag}{REPLACED}"
    return _latest(root) == tag or any(p.name.startswith(replaced) for _, p in copies)


def lost_copy(root: Path, tag: str) -> Path | None:
    """The newest complete copy of ``tag`` when ``tag`` is lost (see the module), else
    None."""
    copies = _copies(root).get(tag, [])
    if not copies or not _is_lost(root, tag, copies):
        return None
    return copies[0][1]


def restore_lost(root: Path) -> list[str]:
    """Rename the newest complete copy of every lost tag of ``root`` back to the tag's name
    (a tag directory that exists without ``meta.json`` is left alone); returns the tags
    restored. Run by the rank that publishes, before a save cleans up."""
    restored = []
    for tag, copies in _copies(root).items():
        if not _is_lost(root, tag, copies) or (root / tag).exists():
            continue
        os.rename(copies[0][1], root / tag)
        restored.append(tag)
        logger.warning(
            "%s was lost by a save killed while replacing it; restored it from %s",
            root / tag,
            copies[0][1].name,
        )
    if restored:
        fsync_dir(root)
    return restored


def copy_of_lost(entry: Path) -> bool:
    """Whether ``entry`` (a ``.tmp-*`` directory) is a complete copy of a lost tag, which a
    stale-directory cleanup must keep (all of them: the ``-replaced-`` one is what shows
    the tag was published)."""
    meta = complete_meta(entry) if entry.is_dir() else None
    if meta is None:
        return False
    root = entry.parent
    return _is_lost(root, meta.tag, _copies(root).get(meta.tag, []))
