"""Saving and loading the engine: DeepSpeed's ``save_checkpoint`` / ``load_checkpoint`` (and
``save_16bit_model``) over ``flatzero.checkpoint``, with the engine's step counters and the
client state stored beside the optimizer's shards."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ...comm import check_same_everywhere
from ...control import every_rank_or_none
from ...own_groups import control_group
from ..zero_to_fp32 import write_script
from .client import link_client_optimizer
from .rank_agreement import (
    agree_on_checkpoint_to_load,
    check_shared_directory,
    user_errors_agreed,
)

if TYPE_CHECKING:
    from ...optim import ZeroOptimizer
    from .config import EngineConfig

__all__ = ["EngineCheckpoints"]

logger = logging.getLogger(__name__)

_ENGINE_STATE = "flatzero_engine"
"""Key of the engine's counters in a checkpoint's client state."""

_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")
"""The engine's step counters, saved with every checkpoint."""


class EngineCheckpoints:
    """The checkpoint methods of ``Engine`` (a base class of it)."""

    module: nn.Module
    optimizer: ZeroOptimizer
    lr_scheduler: Any
    parsed_config: EngineConfig
    client_optimizer: torch.optim.Optimizer | None
    _pg: dist.ProcessGroup | None

    def module_state_dict(
        self,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, Any]:
        """The module's ``state_dict`` (without frozen params if asked), as DeepSpeed's."""
        sd = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters():
                if not p.requires_grad:
                    sd.pop(prefix + name, None)
        return sd

    def save_16bit_model(
        self,
        save_dir: str | Path,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Write the module's weights, in the training dtype, to ``save_dir/save_filename``
        as DeepSpeed's engine does for stages 0-2; returns True.

        Collective: call it on every rank. Rank 0 writes the file from its own flat
        buffers (every rank holds all params), bucket by bucket through host memory: no
        collective, at most one bucket (or the largest tensor outside the buckets) of
        extra host memory, no device memory but for a non-contiguous tensor outside the
        buckets (``flatzero.deepspeed.engine.weights16``). The other
        ranks wait on the control group (gloo, no NCCL watchdog) until it is written; an
        error on rank 0 is raised on every rank. The file appears only complete.

        Args:
            save_dir: the directory (created if needed).
            save_filename: the file's name; ``*.safetensors`` is written as safetensors,
                anything else in ``torch.save``'s format (what DeepSpeed writes).
            exclude_frozen_parameters: leave out params with ``requires_grad=False``.
        """
        from .weights16 import plan_weights, state_nbytes, write_weights

        path = Path(save_dir) / save_filename
        state = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        buckets = [b for group in self.optimizer.flat.groups for b in group.buckets]
        self._save_on_rank0(
            lambda: write_weights(path, plan_weights(state, buckets)),
            state_nbytes(state),
            f"save_16bit_model: rank 0 failed to write {path} (see its error); nothing was "
            "written under that name",
        )
        return True

    save_fp16_model = save_16bit_model

    def save_checkpoint(
        self,
        save_dir: str | Path,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save a checkpoint loadable at any world size (``flatzero.checkpoint``).

        Collective: every rank calls it with the same directory and tag.

        Args:
            save_dir: the checkpoint directory; the checkpoint goes to ``save_dir/tag``.
            tag: default ``global_step<N>`` as DeepSpeed names it.
            client_state: JSON-able state returned by ``load_checkpoint``.
            save_latest: point ``save_dir/latest`` at this checkpoint.
            exclude_frozen_parameters: do not save frozen params and buffers.

        Returns:
            True, as DeepSpeed does. An existing checkpoint of the same tag is replaced (as
            DeepSpeed overwrites it) once the new one is complete. With
            ``"flatzero": {"async_save": true}`` it returns once the copies of the shards
            into host memory are started; a background thread finishes them, writes and
            publishes (the next optimizer step waits for the copies only; the next save,
            load or ``destroy()`` for all of it).
        """
        from ...checkpoint import SaveConfig, save_checkpoint
        from ...checkpoint.collect import save_nbytes
        from ...checkpoint.format import check_tag, encode_value

        if tag is None:
            tag = f"global_step{self.global_steps}"
        counters = {name: getattr(self, name) for name in _COUNTERS}
        extra = {_ENGINE_STATE: counters, "client_state": client_state or {}}
        model = None if exclude_frozen_parameters else self.module
        kwargs = {
            "asynchronous": self.parsed_config.flatzero.async_save,
            "scheduler": self.lr_scheduler,
            "model": model,
            "extra": extra,
            # DeepSpeed writes over an existing tag (Trainer re-saves checkpoint-N when a run
            # resumes into the directory it came from); flatzero replaces it atomically.
            "config": SaveConfig(update_latest=save_latest, overwrite=True),
        }
        # what the save would refuse on one rank, refused on every rank first
        with user_errors_agreed("save_checkpoint", self._pg, catch=(ValueError, TypeError)):
            check_tag(tag)
            encode_value(extra, "client_state")
        check_shared_directory(Path(save_dir), self._pg)
        if self.parsed_config.replicated:
            self._save_on_rank0(
                lambda: save_checkpoint(save_dir, self.optimizer, tag, **kwargs),
                save_nbytes(self.optimizer, model),
                "saving the checkpoint failed on rank 0 (see its error)",
            )
        else:
            save_checkpoint(save_dir, self.optimizer, tag, **kwargs)
        if self.global_rank == 0:  # as DeepSpeed copies its own beside the checkpoints
            write_script(save_dir)
        return True

    def _save_on_rank0(self, save: Callable[[], Any], nbytes: int, elsewhere: str) -> None:
        """Rank 0 runs ``save`` (what every rank holds alike: stage 0's one-rank
        checkpoint, the weights) while the others wait on the control group (gloo: no NCCL
        watchdog), as long as writing ``nbytes`` bytes may take; then every rank raises if
        it failed (ranks other than 0 with ``RuntimeError(elsewhere)``)."""
        control_group(self._pg)  # created (collective) before rank 0 starts writing
        with every_rank_or_none(self._pg, elsewhere, catch=(BaseException,), wait_bytes=nbytes):
            if self.global_rank == 0:
                save()

    def load_checkpoint(
        self,
        load_dir: str | Path,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load a checkpoint saved at any world size.

        Collective: every rank calls it with the same directory and tag.

        Args:
            load_dir: the checkpoint directory.
            tag: which checkpoint; None follows ``load_dir/latest``.
            load_module_strict: every trainable param must be in the checkpoint and vice
                versa.
            load_optimizer_states: restore optimizer state and loss scaler.
            load_lr_scheduler_states: restore the LR scheduler.
            load_module_only: restore the weights only (no optimizer, scheduler or step
                counters).
            custom_load_fn: must be None (DeepSpeed's hook for a custom module loader).

        Returns:
            ``(path, client_state)``; ``(None, None)`` when ``tag`` is None and
            ``load_dir/latest`` does not exist (as DeepSpeed, which warns and returns).
            With ``"flatzero": {"load_fallback": "newest_valid"}`` a missing, incomplete
            or corrupt checkpoint is replaced by the newest that is complete and verifies
            (with a warning; ``path`` is the one loaded).
        """
        from ...checkpoint import LoadConfig, load_checkpoint

        self.wait_for_save()
        if custom_load_fn is not None:
            raise NotImplementedError(
                "engine.load_checkpoint(custom_load_fn=...) is not implemented by flatzero: it "
                "loads the module's weights itself; drop custom_load_fn"
            )
        if not agree_on_checkpoint_to_load(Path(load_dir), tag, self._pg):
            self._warn_nothing_to_load(Path(load_dir) / "latest")
            return None, None
        # before the load's collectives
        with user_errors_agreed("load_checkpoint", self._pg, catch=(ValueError,)):
            _refuse_deepspeed_checkpoint(Path(load_dir), tag)
        config = LoadConfig(
            strict=load_module_strict,
            load_optimizer_states=load_optimizer_states and not load_module_only,
            load_scheduler=load_lr_scheduler_states and not load_module_only,
            fallback=self.parsed_config.flatzero.load_fallback,
        )
        if self.parsed_config.replicated:
            self._agree_on_replicated_load(Path(load_dir), tag, config)
        result = load_checkpoint(
            load_dir,
            self.optimizer,
            tag,
            scheduler=self.lr_scheduler if config.load_scheduler else None,
            model=self.module,
            config=config,
            check_extra=_check_engine_state,
        )
        extra = result.extra if isinstance(result.extra, dict) else {}
        self._after_load(extra, restore_counters=not load_module_only)
        return str(result.path), extra.get("client_state", {})

    def _agree_on_replicated_load(self, load_dir: Path, tag: str | None, config: Any) -> None:
        """Stage 0: every rank loads the one-rank checkpoint alone (``load_checkpoint``
        agrees over a one-rank group), so the ranks check here, on the engine's group, that
        they open the same checkpoint and load it the same way: else their replicas would
        differ, silently. ``ValueError`` on every rank naming each rank's view."""
        from ...checkpoint.format import META, CheckpointMeta
        from ...checkpoint.reader import locate
        from ...checkpoint.validate import fingerprint

        try:
            found, path = locate(load_dir, tag)
            seen = f"tag {found!r}, meta.json {fingerprint(CheckpointMeta.read(path / META))}"
        except ValueError as error:  # the load says it (or falls back) alike on every rank
            seen = f"unreadable ({error})"
        check_same_everywhere(
            "the checkpoint to load and how (every rank must load the same one)",
            {"checkpoint": seen, "load settings": repr(config)},
            control_group(self._pg),
            fix="Pass the same directory, tag and load arguments on every rank, on a file "
            "system every rank shares",
        )

    def wait_for_save(self) -> None:
        """Wait for an asynchronous save still being written, raising its error on every
        rank (collective when one is pending; ``destroy()`` calls it)."""
        from ...checkpoint.checkpointer import wait_for_save

        wait_for_save(self.optimizer)

    def _warn_nothing_to_load(self, latest: Path) -> None:
        if self.global_rank == 0:
            logger.warning(
                "no checkpoint to load: %s has no 'latest' file; pass tag= to load a named "
                "checkpoint",
                latest,
            )

    def _after_load(self, extra: dict[str, Any], *, restore_counters: bool) -> None:
        """The engine's counters from the checkpoint (with ``restore_counters``), a fresh
        accumulation window, and the client optimizer showing the loaded param groups."""
        state = extra.get(_ENGINE_STATE)
        if isinstance(state, dict) and restore_counters:
            for name in _COUNTERS:
                setattr(self, name, int(state.get(name, 0)))
        self._backwards_in_window = 0
        if self.client_optimizer is not None:
            # Loading replaced the optimizer's param groups: show the new ones.
            link_client_optimizer(self.client_optimizer, self.optimizer)


def _check_engine_state(extra: Any) -> None:
    """The engine's counters in a checkpoint's client state are counts (checked before the
    load changes anything; ``ValueError`` naming the counter)."""
    state = extra.get(_ENGINE_STATE) if isinstance(extra, dict) else None
    if state is None:
        return
    if not isinstance(state, dict):
        raise ValueError(
            f"the checkpoint's {_ENGINE_STATE!r} state is a {type(state).__name__}, not the "
            "engine's counters; meta.json was edited or damaged: load another tag"
        )
    for name in _COUNTERS:
        value = state.get(name, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(
                f"the checkpoint's {_ENGINE_STATE}.{name} is {value!r}, not a count >= 0; "
                "meta.json was edited or damaged: load another tag (or load_module_only=True)"
            )


def _refuse_deepspeed_checkpoint(load_dir: Path, tag: str | None) -> None:
    """A checkpoint DeepSpeed wrote (``*_model_states.pt``, no ``meta.json``) gets an error
    that says how to convert it, not "incomplete checkpoint"."""
    if tag is None:
        try:
            tag = (load_dir / "latest").read_text().strip()
        except OSError:
            return
    directory = load_dir / tag
    if (directory / "meta.json").is_file() or not directory.is_dir():
        return
    if any(directory.glob("*_model_states.pt")) or any(directory.glob("*optim_states.pt")):
        raise ValueError(
            f"{directory} is a DeepSpeed checkpoint; flatzero's engine loads flatzero "
            f"checkpoints: convert it with `python -m flatzero import-deepspeed {load_dir} OUT "
            "--tag " + tag + "` (docs/huggingface.md shows how for a Trainer checkpoint), or "
            "resume it without flatzero.patch_deepspeed() / flatzero.run"
        )
