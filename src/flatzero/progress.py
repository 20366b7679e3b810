"""Progress bars for long work: init, saving a checkpoint, ``flatzero export``,
``export-deepspeed`` and ``import-deepspeed``.

A bar shows on rank 0 only, on stderr, and only when stderr is a terminal; the environment
variable ``FLATZERO_PROGRESS`` switches every bar off (``0``, ``false``, ``no``, ``off``) or on
even without a terminal (``1``, ``true``, ``yes``, ``on``: e.g. into a job's log). A caller's
own switch (``FlattenConfig.progress``, a command's ``--no-progress``) turns its bar off
whatever the variable says.
"""

from __future__ import annotations

import argparse
import os
import sys

from tqdm.auto import tqdm

__all__ = ["ENV", "add_progress_argument", "progress_bar", "progress_shown"]

ENV = "FLATZERO_PROGRESS"
"""The environment variable that switches progress bars off (``0``) or on (``1``)."""

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def progress_shown(rank: int = 0, wanted: bool = True) -> bool:
    """Whether a bar shows: ``wanted`` by the caller, on rank 0, and ``FLATZERO_PROGRESS``
    on, or unset with stderr a terminal."""
    if not wanted or rank != 0:
        return False
    value = os.environ.get(ENV, "").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    return sys.stderr.isatty()


def progress_bar(
    total: float | None,
    what: str,
    unit: str,
    *,
    rank: int = 0,
    wanted: bool = True,
    delay_s: float = 0.0,
    scale: bool = False,
) -> tqdm:
    """A bar of ``total`` ``unit`` labelled ``what`` on stderr (disabled where
    ``progress_shown`` says no: ``update`` and ``close`` then cost nothing). ``delay_s``:
    seconds before it appears; ``scale``: show 1.2G rather than 1200000000 (bytes)."""
    return tqdm(
        total=total,
        desc=what,
        unit=unit,
        unit_scale=scale,
        unit_divisor=1024 if scale else 1000,
        delay=delay_s,
        file=sys.stderr,
        disable=not progress_shown(rank, wanted),
        dynamic_ncols=True,
    )


def add_progress_argument(parser: argparse.ArgumentParser) -> None:
    """A command's ``--no-progress`` (``args.no_progress``)."""
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help=f"no progress bar (shown on a terminal unless {ENV}=0)",
    )
