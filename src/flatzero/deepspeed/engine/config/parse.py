"""``parse_config``: a DeepSpeed config -> ``EngineConfig``, section by section."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from ....config import FlattenConfig
from ....dtypes import SHORT_DTYPES, dtype_name
from ....optim import LossScaleConfig, ZeroConfig
from ...target import GRADIENT_CLIPPING_DEFAULT
from .flatzero_section import read_flatzero
from .keys import TOP_NO_EFFECT, TOP_REFUSED
from .optimizer import parse_optimizer, parse_scheduler
from .reader import Section, load_config_dict
from .schema import EngineConfig, FlatzeroSection, PrecisionSection
from .sections import parse_batch, parse_data_types, parse_precision, parse_zero

__all__ = ["parse_config"]


_COMM_DTYPES = {**SHORT_DTYPES, "bfp16": SHORT_DTYPES["bf16"]}
"""``communication_data_type`` choices (``bfp16`` is DeepSpeed's other name of bf16)."""


class _TopKeys(NamedTuple):
    """The top-level keys that are not sections."""

    gradient_clipping: float | None
    steps_per_print: int | None
    reduce_dtype: torch.dtype | None
    """``communication_data_type``; None: not given (the training dtype, as DeepSpeed)."""
    dataloader_drop_last: bool


def _read_top_keys(top: Section) -> _TopKeys:
    clip = top.number("gradient_clipping", GRADIENT_CLIPPING_DEFAULT, minimum=0.0)
    spp = top.raw("steps_per_print", None)
    if isinstance(spp, float) and spp == math.inf:
        spp = None  # Accelerate's "never": it always sets inf
    elif spp is not None:
        spp = top.int("steps_per_print", None)
    comm = top.raw("communication_data_type", None)
    if comm is not None:
        comm = top.choice("communication_data_type", None, tuple(_COMM_DTYPES))
    return _TopKeys(
        gradient_clipping=clip or None,
        steps_per_print=spp,
        reduce_dtype=_COMM_DTYPES[comm] if comm is not None else None,
        dataloader_drop_last=top.bool("dataloader_drop_last", False),
    )


def _default_reduce_dtype(training: torch.dtype | None) -> torch.dtype:
    """The dtype gradients are summed over the ranks in when ``communication_data_type``
    is unset: bf16 for bf16 training, as DeepSpeed's engine (the same config moves the same
    bytes); fp32 otherwise. With fp16 DeepSpeed sums in fp16 too, but it divides each
    rank's loss-scaled gradient by the world size first; flatzero divides once after the
    sum, so an fp16 sum would overflow N times sooner and back the loss scale off more:
    ``"communication_data_type": "fp16"`` asks for it."""
    return torch.bfloat16 if training == torch.bfloat16 else torch.float32


def _refuse_and_list(top: Section) -> None:
    """Top-level keys asking for features flatzero lacks are errors; the rest without
    effect are listed (unknown ones too: DeepSpeed ignores them)."""
    for refusal in TOP_REFUSED:
        top.refuse(*refusal)
    for name, reason in TOP_NO_EFFECT.items():
        top.no_effect(name, reason)
    top.finish(unknown="ignore")


def _flatten_config(
    given: dict[str, Any], ds_bucket: int | None, precision: PrecisionSection
) -> FlattenConfig:
    """``flatzero`` keys, then the DeepSpeed bucket size, then ``FlattenConfig``'s
    defaults; the params are cast to the training dtype while they are flattened."""
    kwargs = dict(given)
    bucket = kwargs.pop("bucket_numel", None) or ds_bucket
    if bucket:
        kwargs["bucket_numel"] = bucket
    dtype = precision.torch_dtype
    return FlattenConfig(**kwargs, dtype=None if dtype is None else dtype_name(dtype))


def _loss_scale(precision: PrecisionSection, stage: int) -> LossScaleConfig | None:
    """The optimizer's loss scaler: the precision's; for fp32 at stages 1 and 2 a fixed
    scale of 1, so that a step with inf/nan gradients is skipped, as DeepSpeed's ZeRO-1/2
    optimizer checks every step for overflow whatever the dtype (its stage 0 does not)."""
    if precision.dtype == "fp32" and stage in (1, 2):
        return LossScaleConfig(init_scale=1.0, dynamic=False)
    return precision.loss_scale


def parse_config(config: Any, *, world_size: int) -> EngineConfig:
    """Parse a DeepSpeed config for ``world_size`` data-parallel ranks.

    Args:
        config: a dict or the path of a JSON file, as ``deepspeed.initialize`` takes.
        world_size: ranks of the process group (for the batch size rule).

    Returns:
        The ``EngineConfig``.

    Raises:
        UnsupportedFeatureError: a key asks for a DeepSpeed feature flatzero does not
            implement (a ``ValueError``; ``flatzero.patch_deepspeed()`` routes such configs to
            DeepSpeed).
        ValueError / TypeError: a key has a bad value or type, is ``"auto"``, is unknown
            inside a parsed section, or the batch sizes disagree.
        Every message names the key, the value, the rule and the fix.
    """
    data = load_config_dict(config)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    ignored: list[tuple[str, str]] = []
    top = Section(data, "", ignored)
    batch = parse_batch(top, world_size)
    zero, ds_bucket, offload = parse_zero(top)
    precision = parse_precision(top)
    data_types = parse_data_types(top, precision, zero.stage)
    optimizer = parse_optimizer(top)
    scheduler = parse_scheduler(top)
    keys = _read_top_keys(top)
    flatzero = read_flatzero(top)
    _refuse_and_list(top)
    return EngineConfig(
        batch=batch,
        zero=zero,
        precision=precision,
        flatten=_flatten_config(
            {**flatzero[FlattenConfig], "master_on_host": offload is not None},
            ds_bucket,
            precision,
        ),
        zero_optimizer=ZeroConfig(
            stage=max(1, zero.stage),
            max_grad_norm=keys.gradient_clipping,
            reduce_dtype=keys.reduce_dtype or _default_reduce_dtype(precision.torch_dtype),
            grad_accum_dtype=data_types.grad_accum_dtype,
            loss_scale=_loss_scale(precision, zero.stage),
            offload_optimizer=offload,
            overlap_param_gather=zero.overlap_comm,
            **flatzero[ZeroConfig],
        ),
        optimizer=optimizer,
        scheduler=scheduler,
        flatzero=FlatzeroSection(**flatzero[FlatzeroSection]),
        buffer_dtype=data_types.buffer_dtype,
        steps_per_print=keys.steps_per_print,
        dataloader_drop_last=keys.dataloader_drop_last,
        ignored=tuple(ignored),
        source=data,
    )
