"""``to_deepspeed``: a flatzero checkpoint as a DeepSpeed 0.19 ZeRO-1/2 one.

``to_deepspeed(ckpt, out, world_size=N)`` writes ``out/<tag>/`` with
``mp_rank_00_model_states.pt`` and one ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``
per rank of a DeepSpeed run of ``N`` data-parallel ranks (``flatzero.deepspeed.writer``), then
``out/latest``: ``engine.load_checkpoint(out)`` resumes the run in DeepSpeed with its
weights, fp32 masters, optimizer state, loss scale, LR schedule, step counters and
client state, and ``zero_to_fp32.py`` consolidates it. ``N`` need not be the world size
the checkpoint was saved at.

Given a Trainer or Accelerate checkpoint directory (``checkpoint-500/`` holding
``global_step500/``, ``latest`` and the Trainer's own files), everything beside the
flatzero checkpoint (``trainer_state.json``, ``scheduler.pt``/``scheduler.bin``, random
states, ``model.safetensors``, ...) is copied into ``out`` byte for byte, so ``out`` is
the same checkpoint for a run on DeepSpeed.

Everything is checked before anything is written (``flatzero.deepspeed.target``); the tag
directory appears only complete (written under a ``.tmp-`` name, renamed), ``latest``
last.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...checkpoint.atomic import staged_directory, write_latest
from ...checkpoint.format import LATEST, META, TMP_PREFIX, CheckpointMeta, check_tag, decode_value
from ...checkpoint.optimizer_state import saved_step
from ...checkpoint.reader import CheckpointReader
from ...progress import progress_bar
from ..layout import MODEL_STATES, optim_file_name
from ..state import deepspeed_scheduler
from ..target import deepspeed_target
from ..writer import plan_deepspeed, write_model_states, write_optim_states
from ..zero_to_fp32 import is_flatzero_script
from .incoming import ENGINE_STATE_KEY

__all__ = [
    "DeepSpeedExportResult",
    "to_deepspeed",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeepSpeedExportResult:
    """What ``to_deepspeed`` wrote.

    Attributes:
        path: the DeepSpeed tag directory (``out/<tag>``).
        tag: its tag (``out/latest`` names it).
        world_size: the data-parallel ranks it is for.
        stage: its ZeRO stage.
        files: the files in ``path``.
        copied: entries copied from beside the flatzero checkpoint (Trainer/Accelerate).
        seconds: wall-clock seconds.
    """

    path: Path
    tag: str
    world_size: int
    stage: int
    files: tuple[str, ...]
    copied: tuple[str, ...]
    seconds: float


def _counters(meta: CheckpointMeta, extra: Mapping[str, Any]) -> dict[str, int | None]:
    """DeepSpeed's step counters: the engine's, else from the optimizer's step."""
    engine = extra.get(ENGINE_STATE_KEY)
    if isinstance(engine, Mapping):
        return {
            "global_steps": int(engine.get("global_steps", 0)),
            "global_samples": int(engine.get("global_samples", 0)),
            "skipped_steps": int(engine.get("skipped_steps", 0)),
        }
    skipped = int((meta.loss_scaler or {}).get("skipped_steps", 0))
    return {
        "global_steps": (saved_step(meta.groups) or 0) + skipped,
        "global_samples": None,
        "skipped_steps": skipped,
    }


def _client_state(extra: Mapping[str, Any]) -> dict[str, Any]:
    """The engine's client state, or (a PyTorch-door checkpoint) the whole ``extra``."""
    if ENGINE_STATE_KEY in extra:
        return dict(extra.get("client_state") or {})
    return dict(extra)


def _beside(checkpoint: Path, reader: CheckpointReader, out: Path) -> list[Path]:
    """What sits beside the flatzero checkpoint in a Trainer/Accelerate directory: every
    entry but ``latest``, flatzero checkpoints, unfinished saves, the door's
    ``zero_to_fp32.py`` (DeepSpeed writes its own at its next save) and ``out`` itself."""
    if reader.path.parent.resolve() != checkpoint.resolve():
        return []
    return sorted(
        entry
        for entry in checkpoint.iterdir()
        if entry.name != LATEST
        and not entry.name.startswith(TMP_PREFIX)
        and not (entry / META).is_file()
        and not is_flatzero_script(entry)
        and entry.resolve() not in (out.resolve(), *out.resolve().parents)
    )


def _check_out(out: Path, tag: str, beside: list[Path], checkpoint: Path, overwrite: bool) -> None:
    if out.resolve() == checkpoint.resolve():
        raise ValueError(
            f"the output directory {out} is the checkpoint directory; export into another"
        )
    if overwrite:
        return
    taken = [p.name for p in beside if (out / p.name).exists()]
    if (out / tag).exists():
        taken.insert(0, tag)
    if taken:
        raise ValueError(
            f"{out} already holds {taken[:4]}; choose another directory or pass "
            "overwrite=True (--overwrite)"
        )


def _copy(entry: Path, out: Path) -> None:
    dest = out / entry.name
    if dest.is_dir() and not dest.is_symlink():
        shutil.rmtree(dest)
    elif dest.exists() or dest.is_symlink():
        dest.unlink()
    if entry.is_dir():
        shutil.copytree(entry, dest, symlinks=True)
    else:
        shutil.copy2(entry, dest, follow_symlinks=False)


def to_deepspeed(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    world_size: int,
    tag: str | None = None,
    out_tag: str | None = None,
    ds_config: Mapping[str, Any] | None = None,
    any_optimizer: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> DeepSpeedExportResult:
    """Write a flatzero checkpoint as DeepSpeed 0.19's ZeRO-1/2 checkpoint.

    Args:
        checkpoint: a flatzero checkpoint directory (``latest`` is followed; a Trainer or
            Accelerate checkpoint directory has its other files copied too) or one tag.
        out_dir: where to write (``out_dir/<tag>``, ``out_dir/latest``).
        world_size: data-parallel ranks of the DeepSpeed run that loads it (one optimizer
            file each; any number, not only the saved one).
        tag: the flatzero tag to export; None follows ``latest``.
        out_tag: the DeepSpeed tag; default the flatzero tag.
        ds_config: the DeepSpeed config of that run: checked against the checkpoint, its
            ``gradient_clipping``, ``fp16`` loss-scaler keys, ``round_robin_gradients`` and
            ``parameter_alignment`` are written as DeepSpeed would, the optimizer state in
            the format of the base optimizer it makes DeepSpeed build (FusedAdam,
            DeepSpeedCPUAdam, torch's: ``flatzero.deepspeed.base_optimizer``; DeepSpeed's
            Muon: ``flatzero.deepspeed.muon_state``), and it is
            stored as ``ds_config``. Without it ``clip_grad`` is left out (the run's own
            applies), an fp16 loss scaler takes DeepSpeed's default window and hysteresis,
            and the optimizer state is written for DeepSpeed's default optimizer for the
            checkpoint's (FusedAdam for Adam and AdamW).
        any_optimizer: write the state of an optimizer that is not one of torch.optim's
            elementwise ones (the DeepSpeed run must use the same class).
        overwrite: replace ``out_dir/<tag>`` and copied entries that exist.
        progress: a bar of the files written on stderr, where ``flatzero.progress`` shows
            one (a terminal; ``FLATZERO_PROGRESS``).

    Returns:
        ``DeepSpeedExportResult``.

    Raises:
        ValueError: the checkpoint is missing or damaged, or DeepSpeed could not load the
            result (``deepspeed_target``: the reason and what DeepSpeed needs); nothing is
            written then.
    """
    t0 = time.perf_counter()
    root, out = Path(checkpoint), Path(out_dir)
    with CheckpointReader(root, tag) as reader:
        meta = reader.meta
        target = deepspeed_target(meta, world_size, ds_config, any_optimizer=any_optimizer)
        plan = plan_deepspeed(reader, target)
        ds_tag = check_tag(out_tag or reader.tag)
        beside = _beside(root, reader, out)
        _check_out(out, ds_tag, beside, root, overwrite)
        extra = decode_value(meta.extra) if isinstance(meta.extra, dict) else {}
        counters = _counters(meta, extra)
        out.mkdir(parents=True, exist_ok=True)
        bar = progress_bar(world_size + 1, "export-deepspeed", "file", wanted=progress)
        with bar, staged_directory(out / ds_tag, overwrite=overwrite) as tmp:
            write_model_states(
                tmp / MODEL_STATES,
                reader,
                plan,
                counters=counters,
                scheduler=deepspeed_scheduler(decode_value(meta.scheduler)),
                client_state=_client_state(extra),
            )
            files = [MODEL_STATES]
            bar.update(1)
            for rank in range(world_size):
                name = optim_file_name(rank, target.dtype)
                write_optim_states(
                    tmp / name,
                    reader,
                    plan,
                    rank,
                    loss_scaler=meta.loss_scaler,
                    steps=int(counters["global_steps"] or 0),
                )
                files.append(name)
                bar.update(1)
    for entry in beside:
        _copy(entry, out)
    write_latest(out, ds_tag)
    result = DeepSpeedExportResult(
        out / ds_tag,
        ds_tag,
        world_size,
        target.stage,
        tuple(files),
        tuple(p.name for p in beside),
        time.perf_counter() - t0,
    )
    logger.info(
        "exported %s as a DeepSpeed ZeRO-%d checkpoint for %d ranks: %s (%d files, %d "
        "copied beside it) in %.1f s",
        reader.path,
        result.stage,
        world_size,
        result.path,
        len(files),
        len(beside),
        result.seconds,
    )
    return result
