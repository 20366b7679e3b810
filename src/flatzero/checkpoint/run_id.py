"""The id of the job a save belongs to, recorded in ``meta.json`` (``CheckpointMeta.run_id``).

Two jobs saving into one directory would otherwise replace each other's tags silently. A
save that replaces a tag written by another run warns, naming both ids. The id is the
launcher's when it gives one that names the job: ``torchrun``'s ``TORCHELASTIC_RUN_ID``
(``--rdzv-id``; not its default ``none``), else Slurm's ``SLURM_JOB_ID``; else one made at
the first save of the process. The ranks take rank 0's (agreed with the save's tag).
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

from .format import META, CheckpointMeta

__all__ = ["run_id", "warn_if_another_run"]

logger = logging.getLogger(__name__)

_made: list[str] = []
"""The id made by this process when the launcher gives none (made once)."""


def run_id() -> str:
    """This job's run id (see the module's docstring)."""
    elastic = os.environ.get("TORCHELASTIC_RUN_ID", "").strip()
    if elastic and elastic != "none":
        return elastic
    slurm = os.environ.get("SLURM_JOB_ID", "").strip()
    if slurm:
        return f"slurm-{slurm}"
    if not _made:
        _made.append(f"pid{os.getpid()}-{secrets.token_hex(4)}")
    return _made[0]


def warn_if_another_run(final: Path, run: str) -> None:
    """(Rank 0, about to replace the checkpoint ``final``.) Warn when another run wrote it,
    naming both ids."""
    try:
        previous = CheckpointMeta.read(final / META).run_id
    except ValueError:  # damaged: nothing to compare (older checkpoints have no run id)
        return
    if previous is not None and previous != run:
        logger.warning(
            "checkpoint %s was written by run %s and is being replaced by run %s: two jobs "
            "saving into one directory replace each other's checkpoints; give each job a "
            "directory of its own (or resume with the same run id: torchrun --rdzv-id)",
            final,
            previous,
            run,
        )
