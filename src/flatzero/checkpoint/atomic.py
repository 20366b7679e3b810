"""Making a checkpoint appear only complete: temporary directory, fsync, rename or exchange.

A save writes everything into ``DIR/.tmp-<tag>-<nonce>/``; once every file is written and
fsynced, it becomes ``DIR/<tag>/`` and then a fsynced temporary file renamed over
``DIR/latest`` names it. A crash at any point leaves either the old state or the new one
visible, plus possibly ``.tmp-*`` entries that loaders ignore and a later save removes.

Replacing an existing tag is one ``renameat2(RENAME_EXCHANGE)`` on Linux (ext4, xfs,
btrfs, tmpfs, ...): the complete new directory and the old one swap names in one step, so
``DIR/<tag>`` is complete at every instant, and the old copy, now under the temporary
name, is removed after. Where the exchange is not available (another OS, a file system
that refuses it: ``EINVAL``), the old directory is renamed aside to
``.tmp-<tag>-replaced-<pid>`` and the new one renamed in: between those two renames
``DIR/<tag>`` does not exist, and ``recovery`` finds the complete copies (the loader loads
the newest with a warning; the next save puts it back under its tag).

``StagedDirectory`` (``staged_directory`` as a context manager) is that temporary
directory for whatever writes one: a save, ``import-deepspeed``, ``export-deepspeed``.

``set_fault_hook`` is the test seam of every step of a save (here and in ``writer``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .format import LATEST, TMP_PREFIX, read_latest

__all__ = [
    "REMOVING",
    "REPLACED",
    "StagedDirectory",
    "exchange",
    "fault_point",
    "fsync_dir",
    "point_latest",
    "publish",
    "remove_in_background",
    "remove_stale_tmp",
    "set_fault_hook",
    "staged_directory",
    "tmp_dir_name",
    "wait_for_removals",
    "write_latest",
]

logger = logging.getLogger(__name__)

REMOVING = f"{TMP_PREFIX}.removing-"
"""Prefix of a directory being deleted in the background (``remove_in_background``). No tag
starts with a dot, so no save's temporary directory ``.tmp-<tag>-<nonce>`` has it: whatever
has it is garbage, and a save removes it at any age."""

REPLACED = "-replaced-"
"""Infix of the name an overwritten tag is renamed aside to when the exchange is not
available: ``.tmp-<tag>-replaced-<pid>``."""

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_NOT_SUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV)
"""errnos of ``renameat2`` that mean "not here" (the fallback runs), not "failed"."""

_fault_hook: Callable[[str, int], None] | None = None


def set_fault_hook(hook: Callable[[str, int], None] | None) -> None:
    """Test seam: call ``hook(point, rank)`` at points of a save so a test can kill the
    process (or raise) exactly there. ``None`` removes it.

    Points: ``"tensor_written"`` after each tensor of a rank file, ``"rank_file_written"``,
    ``"before_publish"`` (``meta.json`` written, nothing renamed), ``"after_exchange"``
    (replacing a tag: the new directory is in, the old one not yet removed),
    ``"between_renames"`` (replacing without the exchange: the old directory is aside, the
    new one not yet in), ``"before_latest"`` (published, ``latest`` not yet moved),
    ``"snapshot_taken"`` (an asynchronous save laid its snapshot out, started its copies
    and is about to return), ``"copying_snapshot"`` (its background thread, before it
    copies the host shards into the snapshot).
    Publishing points report rank 0, the only rank that publishes.
    """
    global _fault_hook
    _fault_hook = hook


def fault_point(point: str, rank: int) -> None:
    """Run the fault hook, if any, at ``point``."""
    if _fault_hook is not None:
        _fault_hook(point, rank)


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


def _renameat2() -> Callable[..., int] | None:
    """glibc's ``renameat2``, or None (not Linux, or a libc without it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange(a: Path, b: Path) -> bool:
    """Swap the names of the existing paths ``a`` and ``b`` in one atomic step
    (``renameat2(RENAME_EXCHANGE)``); False where the system cannot (nothing changed).

    Raises:
        OSError: the exchange is supported but failed (permissions, a missing path).
    """
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NOT_SUPPORTED:
        return False
    raise OSError(code, f"exchanging {a} and {b} failed: {os.strerror(code)}")


def publish(tmp: Path, final: Path, *, overwrite: bool) -> None:
    """Make the complete directory ``tmp`` appear as ``final``, atomically.

    With ``overwrite`` an existing ``final`` is replaced: by one exchange where the system
    has it (``final`` is complete at every instant; the old copy is removed after), else
    by renaming the old one aside to ``.tmp-<tag>-replaced-<pid>`` and the new one in
    (``recovery`` covers the instant between).

    Raises:
        FileExistsError: ``final`` exists and not ``overwrite``.
        OSError: a rename failed.
    """
    fsync_dir(tmp)
    if not final.exists():
        os.rename(tmp, final)
        fsync_dir(final.parent)
        return
    if not overwrite:
        raise FileExistsError(f"{final} already exists")
    if exchange(tmp, final):
        fsync_dir(final.parent)
        fault_point("after_exchange", 0)
        remove_in_background(tmp)  # the old copy, under the temporary name
        return
    old = final.with_name(f"{TMP_PREFIX}{final.name}{REPLACED}{os.getpid()}")
    os.rename(final, old)
    fault_point("between_renames", 0)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    remove_in_background(old)


@dataclass(frozen=True)
class StagedDirectory:
    """A directory written under a temporary name beside where it will appear.

    Attributes:
        final: where the complete directory appears (``publish``).
        tmp: the temporary directory beside it, ``.tmp-<name>-<nonce>``, that loaders
            ignore and a later save removes when it is left behind.
    """

    final: Path
    tmp: Path

    @classmethod
    def beside(cls, final: Path, nonce: str | None = None) -> StagedDirectory:
        """The staged directory of ``final`` (``nonce``: random hex when None)."""
        name = tmp_dir_name(final.name, nonce or secrets.token_hex(6))
        return cls(final, final.parent / name)

    def create(self) -> None:
        """Create the temporary directory (its parent must exist)."""
        self.tmp.mkdir()

    def publish(self, *, overwrite: bool) -> None:
        """fsync the temporary directory and make it appear as ``final`` (``publish``)."""
        publish(self.tmp, self.final, overwrite=overwrite)

    def discard(self) -> None:
        """Remove the temporary directory and whatever is in it (nothing if it is gone)."""
        shutil.rmtree(self.tmp, ignore_errors=True)


@contextlib.contextmanager
def staged_directory(final: Path, *, overwrite: bool) -> Iterator[Path]:
    """A new temporary directory beside ``final`` to write into; when the block ends
    without an error it is fsynced and appears as ``final`` (replacing an existing one
    with ``overwrite``: ``publish``), else it is removed and the error propagates.

    Raises:
        FileExistsError: ``final`` exists and not ``overwrite`` (nothing is left behind).
    """
    staged = StagedDirectory.beside(final)
    staged.create()
    try:
        yield staged.tmp
        staged.publish(overwrite=overwrite)
    except BaseException:
        staged.discard()
        raise


_removals: list[threading.Thread] = []
_removals_lock = threading.Lock()


def remove_in_background(path: Path) -> None:
    """Rename the directory ``path`` (a checkpoint no ``latest`` names, or an old copy
    under a ``.tmp-`` name) to a ``REMOVING`` name, which frees its name at once and which
    loaders and recovery ignore, then delete it in a thread of its own, and return.

    Deleting gigabytes can take the disk's time but no CPU: on a file system mounted with
    ``discard`` (usual on cloud VMs) each freed extent is trimmed before ``unlink`` returns
    (0.70 s wall and 0.00 CPU-s for a 5 GiB file on the development VM), so a save that
    replaces a tag or prunes old checkpoints does not wait for it. The thread is not a
    daemon (a process that ends normally finishes the deletion first;
    ``engine.destroy()`` waits for it); a kill leaves the ``REMOVING`` directory, which
    the next save removes whatever its age (``remove_stale_tmp``)."""
    doomed = path.with_name(f"{REMOVING}{secrets.token_hex(4)}")
    try:
        os.rename(path, doomed)
    except OSError as error:  # deleted under its own name then
        logger.debug("could not rename %s before deleting it: %s", path, error)
        doomed = path
    thread = threading.Thread(target=_remove, args=(doomed,), name=f"flatzero-remove-{doomed.name}")
    with _removals_lock:  # started within: wait_for_removals never joins an unstarted one
        _removals[:] = [t for t in _removals if t.is_alive()]
        thread.start()
        _removals.append(thread)


def _remove(path: Path) -> None:
    """(A removal's thread.) Delete ``path``, whatever fails on the way."""
    fault_point("removing", 0)
    shutil.rmtree(path, ignore_errors=True)


def wait_for_removals() -> None:
    """Wait until every removal this process started (``remove_in_background``) is done."""
    with _removals_lock:
        pending = list(_removals)
    for thread in pending:
        thread.join()


def write_latest(directory: Path, tag: str) -> None:
    """Point ``directory/latest`` at ``tag`` (temporary file, fsync, rename, fsync)."""
    tmp = directory / f"{TMP_PREFIX}{LATEST}-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(tag + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / LATEST)
    fsync_dir(directory)


def point_latest(root: Path, tag: str) -> None:
    """``write_latest`` once ``root/tag`` is published; its error says what is true: the
    checkpoint is complete and published, ``latest`` still names the old tag.

    Raises:
        OSError: of the system's errno, naming both tags and the way to fix it.
    """
    try:
        write_latest(root, tag)
    except OSError as error:
        try:
            old = f"still names {read_latest(root)!r}"
        except ValueError:
            old = "is unchanged"
        raise OSError(
            error.errno,
            f"checkpoint {root / tag} is complete and published, but {root / LATEST} could "
            f"not be rewritten ({error.strerror or error}) and {old}: load the new one with "
            f"tag={tag!r}, or fix {root / LATEST} (it must be a file holding the tag) before "
            "the next save",
        ) from error


def remove_stale_tmp(
    directory: Path,
    keep: str,
    *,
    min_age_s: float = 0.0,
    protected: Callable[[Path], bool] = lambda _: False,
) -> list[str]:
    """Remove ``.tmp-*`` entries of ``directory`` other than ``keep`` (left by killed saves)
    whose last change is at least ``min_age_s`` seconds old, except those ``protected``
    says to keep (``recovery.copy_of_lost``: a complete copy of a lost tag); returns the
    names removed."""
    removed = []
    now = time.time()
    for entry in directory.iterdir():
        if not entry.name.startswith(TMP_PREFIX) or entry.name == keep:
            continue
        try:
            doomed = entry.name.startswith(REMOVING)  # garbage at any age
            if not doomed and (now - entry.stat().st_mtime < min_age_s or protected(entry)):
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
