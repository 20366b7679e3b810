"""Getting the model's weights into flat buckets, the one step of ``flatzero.initialize``
that has three ways:

- params with their values (host, GPU): ``flatten_parameters``, casting to the training
  dtype bucket by bucket;
- a meta-device model and a safetensors checkpoint: ``loading.load_flat`` (each rank reads
  only its slices' bytes);
- a meta-device model and a flatzero checkpoint: the buckets are allocated
  (``flatten_parameters(allocate_only=True)``), and the engine loads the checkpoint into
  them once it exists; the model never gets storage of its own.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torch import nn

from ...config import FlattenConfig
from ...dtypes import dtype_name
from ...flatten import FlatParams, flatten_parameters
from ...loading import allocate_rest, load_flat
from ...params import ParamGroup

__all__ = ["Weights", "check_checkpoint_argument", "get_weights"]


@dataclass(frozen=True)
class Weights:
    """The model's trainable params in flat buckets, and where their values came from.

    Attributes:
        flat: the buckets.
        source: where the weights came from, for the report (``"cpu float32"``,
            ``"meta+safetensors"``, ``"meta+flatzero checkpoint"``).
        from_checkpoint: every rank read them from a checkpoint (no need to agree).
        checkpoint_dir: a flatzero checkpoint to load into the buckets once the engine
            exists, or None.
    """

    flat: FlatParams
    source: str
    from_checkpoint: bool = False
    checkpoint_dir: Path | None = None


def _is_flatzero_checkpoint(path: Path) -> bool:
    return path.is_dir() and ((path / "latest").is_file() or (path / "meta.json").is_file())


def _describe(groups: list[ParamGroup]) -> str:
    """Where the params are and their dtypes (``"cpu float32"``)."""
    params = [p for g in groups for p in (*g.params, *g.frozen)]
    devices = ",".join(sorted({str(p.device) for p in params}))
    return f"{devices} {'/'.join(sorted({dtype_name(p.dtype) for p in params}))}"


def check_checkpoint_argument(groups: list[ParamGroup], checkpoint: object) -> str:
    """``checkpoint=`` given exactly when the params are on the meta device, and existing
    (checked by ``initialize`` on every rank before anything is flattened); what it is
    (``"none"``, ``"flatzero checkpoint"``, ``"safetensors"``), which every rank must agree
    on: each kind runs other collectives.

    Raises:
        ValueError: ``checkpoint`` given for a model with weights, missing for a meta one,
            or not there.
    """
    _check_checkpoint_argument(_on_meta(groups), checkpoint)
    if checkpoint is None:
        return "none"
    path = Path(checkpoint)  # type: ignore[arg-type]
    if not path.exists():
        raise ValueError(
            f"checkpoint={str(path)!r} does not exist; pass a safetensors file or directory, "
            "or a flatzero checkpoint directory, that every rank can read"
        )
    return "flatzero checkpoint" if _is_flatzero_checkpoint(path) else "safetensors"


def _on_meta(groups: list[ParamGroup]) -> bool:
    return any(p.device.type == "meta" for g in groups for p in (*g.params, *g.frozen))


def _check_checkpoint_argument(on_meta: bool, checkpoint: object) -> None:
    if on_meta and checkpoint is None:
        raise ValueError(
            "the model's params are on the meta device; pass checkpoint= (a safetensors "
            "file or directory, or a flatzero checkpoint) to load them from"
        )
    if not on_meta and checkpoint is not None:
        raise ValueError(
            "checkpoint= is for models on the meta device; this model has its weights. "
            "Use engine.load_checkpoint(dir) to load a checkpoint into it"
        )


def _allocated(
    model: nn.Module,
    groups: list[ParamGroup],
    flatten: Callable[..., FlatParams],
    path: Path,
    init_buffers: Callable[[nn.Module], None] | None,
) -> Weights:
    """Buckets and the rest get storage (uninitialized, never a second copy of the model);
    the weights are loaded into them once the engine exists."""
    if init_buffers is None and any(b.device.type == "meta" for b in model.buffers()):
        raise ValueError(
            "the model has buffers on the meta device; pass init_buffers=fn to compute "
            "them (a flatzero checkpoint holds only persistent buffers)"
        )
    flat = flatten(groups, allocate_only=True)
    allocate_rest(model, flat.groups[0].device)
    if init_buffers is not None:
        init_buffers(model)
    return Weights(flat, "meta+flatzero checkpoint", from_checkpoint=True, checkpoint_dir=path)


def get_weights(
    model: nn.Module,
    groups: list[ParamGroup],
    config: FlattenConfig,
    *,
    replicated: bool,
    checkpoint: str | os.PathLike[str] | None,
    key_map: Callable[[str], str] | None,
    init_buffers: Callable[[nn.Module], None] | None,
) -> Weights:
    """Flatten ``groups`` (collected from ``model``) with ``config``, from the params or from
    ``checkpoint`` for a meta-device model. Collective over the default process group.

    ``replicated`` (stage 0 at several ranks) shards over a one-rank group per rank (every
    rank holds the whole model) and takes the decisions over all of them.

    Raises:
        ValueError: ``checkpoint`` given for a model with weights, or missing for a meta
            one; meta buffers without ``init_buffers``; whatever flattening raises.
    """
    on_meta = _on_meta(groups)
    _check_checkpoint_argument(on_meta, checkpoint)
    shard_group = dist.new_subgroups(group_size=1)[0] if replicated else None
    flatten = functools.partial(
        flatten_parameters,
        process_group=shard_group,
        config=config,
        agreement_group=dist.group.WORLD,
    )
    if not on_meta:
        source = _describe(groups)  # before flattening moves and casts them
        return Weights(flatten(groups), source)
    path = Path(checkpoint)  # type: ignore[arg-type]
    if _is_flatzero_checkpoint(path):
        return _allocated(model, groups, flatten, path, init_buffers)
    flat = load_flat(
        model,
        path,
        key_map=key_map,
        init_buffers=init_buffers,
        process_group=shard_group,
        config=config,
        params=groups,
        agreement_group=dist.group.WORLD,
    )
    return Weights(flat, "meta+safetensors", from_checkpoint=True)
