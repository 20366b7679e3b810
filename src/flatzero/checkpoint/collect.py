"""What a save writes, collected and checked before any file is touched (no collective)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._version import __version__
from ..flatten import FlatParams
from ..optim import ZeroOptimizer
from .config import SaveConfig
from .format import CheckpointMeta, FileRecord, check_tag, encode_value
from .optimizer_state import CapturedState, capture
from .rng import capture_rng
from .writer import model_extras

__all__ = ["Collected", "RankFiles", "collect", "layout_names", "rank_files", "save_nbytes"]


@dataclass(frozen=True)
class RankFiles:
    """What this rank writes: its rank file's tensors (state shards, then RNG states) and
    metadata, and on rank 0 the model's rest. Live tensors for a synchronous save, their
    copies in host memory for an asynchronous one. ``frozen``: the names in ``rest`` of
    frozen params (no forward pass changes them: an asynchronous save copies them as it
    copies the shards, not before it returns)."""

    tensors: list[tuple[str, torch.Tensor]]
    metadata: dict[str, str]
    rest: list[tuple[str, torch.Tensor]]
    frozen: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Collected:
    """What a save writes, collected and checked before any file is touched.

    Attributes:
        captured: the optimizer's state, split for the format (references).
        tag: this rank's tag for the checkpoint (the ranks agree on it next).
        scheduler: the LR scheduler's ``state_dict()``, encoded, or None.
        extra: the user's client state, encoded (``{}`` when none).
        rest: the model's frozen params and buffers by name (rank 0 writes them).
        model_names: layout param name -> the model's name, where they differ.
        aliases: second names of tied params -> the name they are stored under.
    """

    captured: CapturedState
    tag: str
    scheduler: Any
    extra: Any
    rest: dict[str, torch.Tensor]
    model_names: dict[str, str]
    aliases: dict[str, str]

    def written_at_most(self) -> int:
        """Bytes the busiest rank writes: rank 0, its shards (every rank's are the same
        size) and the model's rest."""
        return _tensor_bytes([t for _, t in self.captured.tensors] + list(self.rest.values()))

    def meta(
        self,
        tag: str,
        records: Sequence[FileRecord],
        rest_record: FileRecord | None,
        flat: FlatParams,
        config: SaveConfig,
    ) -> CheckpointMeta:
        """The checkpoint's ``meta.json`` (rank 0 writes it)."""
        return self.captured.meta(
            tag=tag,
            layout=flat.layout,
            files=tuple(records),
            scheduler=self.scheduler,
            extra=self.extra,
            rng=config.save_rng,
            model_rest=rest_record.file if rest_record is not None else None,
            rest_record=rest_record,
            model_names=self.model_names,
            aliases=self.aliases,
            versions={"flatzero": __version__, "torch": torch.__version__},
            saved_at=time.time(),
        )


def _tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def layout_names(flat: FlatParams) -> dict[int, str]:
    """``id(param) -> name in the layout`` of every flattened param."""
    return {id(p): n for g in flat.groups for n, p in zip(g.names, g.params, strict=True)}


def save_nbytes(optimizer: ZeroOptimizer, model: torch.nn.Module | None = None) -> int:
    """About how many bytes ``save_checkpoint(..., optimizer, model=model)`` writes on rank 0:
    its master and per-element optimizer-state shards, and the model's frozen params and
    buffers (no collective, nothing copied)."""
    groups = optimizer.sharded_state().groups
    nbytes = _tensor_bytes([t for g in groups for t in (g.master, *g.shards.values())])
    if model is not None:
        with contextlib.suppress(ValueError):  # meta tensors: save_checkpoint says so
            rest = model_extras(model, layout_names(optimizer.flat))[0]
            nbytes += _tensor_bytes(rest.values())
    return nbytes


def collect(
    optimizer: ZeroOptimizer,
    tag: str | None,
    scheduler: Any,
    model: torch.nn.Module | None,
    extra: Any,
) -> Collected:
    """Everything this rank saves (no copy).

    Raises:
        ValueError / TypeError: an unusable tag, or a state the format cannot hold.
    """
    captured = capture(optimizer.sharded_state())
    rest: dict[str, torch.Tensor] = {}
    model_names: dict[str, str] = {}
    aliases: dict[str, str] = {}
    if model is not None:
        rest, model_names, aliases = model_extras(model, layout_names(optimizer.flat))
    return Collected(
        captured=captured,
        tag=check_tag(tag if tag is not None else f"step{captured.state.step or 0}"),
        scheduler=(
            encode_value(scheduler.state_dict(), "scheduler.state_dict()")
            if scheduler is not None
            else None
        ),
        extra=encode_value(extra, "extra") if extra is not None else {},
        rest=rest,
        model_names=model_names,
        aliases=aliases,
    )


def rank_files(collected: Collected, flat: FlatParams, config: SaveConfig) -> RankFiles:
    """What this rank writes (its RNG states captured now, with ``save_rng``)."""
    tensors = list(collected.captured.tensors)
    metadata: dict[str, str] = {}
    if config.save_rng:
        rng_tensors, metadata = capture_rng()
        tensors += rng_tensors
    rest = list(collected.rest.items()) if flat.rank == 0 else []
    return RankFiles(tensors, metadata, rest)
