"""The start of a save: what every rank agrees on (the tag, rank 0's nonce and run id)
and the temporary directory rank 0 creates for it ([Note: the save protocol] in ``save``,
steps 1 and 2)."""

from __future__ import annotations

import errno
import secrets
from typing import Any

import torch.distributed as dist

from ..comm import world_size_of
from ..control import every_rank_or_none
from ..flatten import FlatParams
from ..own_groups import control_group
from .atomic import StagedDirectory, remove_stale_tmp
from .config import SaveConfig
from .recovery import copy_of_lost, restore_lost
from .run_id import run_id, warn_if_another_run

__all__ = ["agree_tag", "create_tmp"]


def agree_tag(tag: str, group: dist.ProcessGroup | None) -> tuple[str, str, str]:
    """Every rank's tag must be the same; returns it, rank 0's nonce and rank 0's run id
    (gathered on the control group of ``group``)."""
    mine = (tag, secrets.token_hex(6), run_id())
    if world_size_of(group) == 1:
        return mine
    values: list[Any] = [None] * world_size_of(group)
    dist.all_gather_object(values, mine, group=control_group(group))
    tags = {t for t, _, _ in values}
    if len(tags) != 1:
        raise ValueError(
            f"ranks passed different checkpoint tags ({sorted(tags)[:4]}); pass the same tag "
            "on every rank (or none: the default is derived from the optimizer step)"
        )
    return values[0]


def create_tmp(staged: StagedDirectory, flat: FlatParams, config: SaveConfig, run: str) -> None:
    """Rank 0 creates the temporary directory (removing stale ones first); every rank
    learns whether that worked."""
    root, final = staged.final.parent, staged.final
    # wait_bytes=0: the others wait while rank 0 may be removing stale directories
    with every_rank_or_none(
        flat.process_group,
        f"saving the checkpoint failed on another rank while creating {staged.tmp} (see its error)",
        catch=(OSError, ValueError),
        wait_bytes=0,
    ):
        if flat.rank == 0:
            if root.exists() and not root.is_dir():
                raise NotADirectoryError(
                    errno.ENOTDIR,
                    f"{root} is a file, not a checkpoint directory: pass the directory to save "
                    "into (it is created if needed)",
                )
            root.mkdir(parents=True, exist_ok=True)
            restore_lost(root)
            if final.exists() and not config.overwrite:
                raise ValueError(
                    f"checkpoint {final} already exists; choose another tag or save with "
                    "SaveConfig(overwrite=True)"
                )
            if final.exists():
                warn_if_another_run(final, run)
            if config.stale_tmp_age_s is not None:
                remove_stale_tmp(
                    root,
                    keep=staged.tmp.name,
                    min_age_s=config.stale_tmp_age_s,
                    protected=copy_of_lost,
                )
            staged.create()
