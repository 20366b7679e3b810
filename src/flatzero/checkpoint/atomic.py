"""Making a checkpoint appear only complete: temporary directory, fsync, rename.

A save writes everything into ``DIR/.tmp-<tag>-<nonce>/``; once every file is written and
fsynced, one ``rename`` makes it ``DIR/<tag>/`` and a second one (of a fsynced temporary
file) points ``DIR/latest`` at it. A crash at any point leaves either the old state or the
new one visible, plus possibly a ``.tmp-*`` directory that loaders never look at and a
later save removes.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from .format import LATEST, TMP_PREFIX

__all__ = ["fsync_dir", "publish", "remove_stale_tmp", "tmp_dir_name", "write_latest"]

logger = logging.getLogger(__name__)


def tmp_dir_name(tag: str, nonce: str) -> str:
    """Name of the temporary directory a save of ``tag`` writes into."""
    return f"{TMP_PREFIX}{tag}-{nonce}"


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that renames and new entries in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path, *, overwrite: bool) -> None:
    """Rename the complete ``tmp`` directory to ``final``, atomically.

    With ``overwrite`` an existing ``final`` is first renamed aside and removed after the
    new one is in place (a crash in between leaves the old one under a ``.tmp-`` name and
    no ``final``; ``latest`` still points at whatever it pointed at).
    """
    fsync_dir(tmp)
    old = None
    if final.exists():
        if not overwrite:
            raise FileExistsError(f"{final} already exists")
        old = final.with_name(f"{TMP_PREFIX}{final.name}-replaced-{os.getpid()}")
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_latest(directory: Path, tag: str) -> None:
    """Point ``directory/latest`` at ``tag`` (temporary file, fsync, rename, fsync)."""
    tmp = directory / f"{TMP_PREFIX}{LATEST}-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(tag + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / LATEST)
    fsync_dir(directory)


def remove_stale_tmp(directory: Path, keep: str, *, min_age_s: float = 0.0) -> list[str]:
    """Remove ``.tmp-*`` entries of ``directory`` other than ``keep`` (left by killed saves)
    whose last change is at least ``min_age_s`` seconds old; returns their names."""
    removed = []
    now = time.time()
    for entry in directory.iterdir():
        if not entry.name.startswith(TMP_PREFIX) or entry.name == keep:
            continue
        try:
            if now - entry.stat().st_mtime < min_age_s:
                continue
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry.name)
        except OSError as error:  # another process may be removing it too
            logger.debug("could not remove %s: %s", entry, error)
    if removed:
        logger.info("removed %d unfinished save(s) in %s: %s", len(removed), directory, removed)
    return removed
