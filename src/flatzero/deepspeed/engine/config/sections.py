"""Parsing the batch sizes, ``zero_optimization`` and ``bf16``/``fp16`` of a DeepSpeed
config, with DeepSpeed's rules."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from ....dtypes import dtype_name
from ....optim import LossScaleConfig, OffloadConfig
from .keys import DATA_TYPES_NO_EFFECT, STAGE3_KEYS, ZERO_MAIN_KEYS, ZERO_NO_EFFECT, ZERO_REFUSED
from .offload import parse_offload_optimizer
from .reader import Section
from .schema import BatchConfig, PrecisionSection, ZeroSection

__all__ = ["parse_batch", "parse_data_types", "parse_precision", "parse_zero"]

ACCUM_DTYPES: Mapping[str, torch.dtype] = {
    **dict.fromkeys(("fp32", "float32", "float", "torch.float32"), torch.float32),
    **dict.fromkeys(("bf16", "bfloat16", "torch.bfloat16"), torch.bfloat16),
    **dict.fromkeys(("fp16", "float16", "half", "torch.float16"), torch.float16),
}
"""``data_types.grad_accum_dtype`` and ``buffer_dtype`` names, as DeepSpeed's
``DtypeEnum`` spells them."""


# [Note: DeepSpeed's batch-size rule.
# The batch sizes follow DeepSpeed's rule: ``train_batch_size = train_micro_batch_size_per_gpu
# * gradient_accumulation_steps * world_size``; any two determine the third (with DeepSpeed's
# integer divisions), one alone sets ``gradient_accumulation_steps = 1``, and the three must
# then agree exactly.]
def parse_batch(top: Section, world_size: int) -> BatchConfig:
    """The batch sizes, with DeepSpeed's rule (``_set_batch_related_parameters``, with its
    integer divisions): any two give the third, one alone sets ``gas = 1``."""
    train = top.int("train_batch_size", None)
    micro = top.int("train_micro_batch_size_per_gpu", None)
    gas = top.int("gradient_accumulation_steps", None)
    if train is not None and micro is not None and gas is not None:
        pass
    elif train is not None and micro is not None:
        gas = train // micro // world_size
    elif train is not None and gas is not None:
        micro = train // world_size // gas
    elif micro is not None and gas is not None:
        train = micro * gas * world_size
    elif train is not None:
        gas, micro = 1, train // world_size
    elif micro is not None:
        gas, train = 1, micro * world_size
    else:
        raise ValueError(
            "config needs train_batch_size or train_micro_batch_size_per_gpu (DeepSpeed's "
            "rule: train_batch_size = train_micro_batch_size_per_gpu * "
            "gradient_accumulation_steps * world size); add one of them"
        )
    for name, value in (
        ("train_batch_size", train),
        ("train_micro_batch_size_per_gpu", micro),
        ("gradient_accumulation_steps", gas),
    ):
        if value < 1:
            raise ValueError(
                f"config: {name} comes out as {value} at world size {world_size} "
                f"(train_batch_size={train}, train_micro_batch_size_per_gpu={micro}, "
                f"gradient_accumulation_steps={gas}); train_batch_size must be at least "
                "train_micro_batch_size_per_gpu * gradient_accumulation_steps * world size"
            )
    assert train is not None and micro is not None and gas is not None
    return BatchConfig(train, micro, gas, world_size)


def _read_stage(zero: Section) -> int:
    stage = zero.int("stage", 0, minimum=0)
    if stage == 3:
        raise zero.unsupported(
            "stage",
            stage,
            "flatzero implements ZeRO stages 0, 1 and 2; stage 3 (partitioned parameters) is "
            "not implemented",
            "use stage 1 or 2, or DeepSpeed itself for stage 3",
            "ZeRO stage 3",
        )
    if stage > 3:
        raise zero.fail("stage", stage, "ZeRO stages are 0, 1, 2 (and 3)", "use 0, 1 or 2")
    return stage


def _note_switches(zero: Section, stage: int) -> bool | None:
    """``overlap_comm``: returned (None when absent), the param all-gathers' overlap
    (``ZeroConfig.overlap_param_gather``); ``false`` at stage 2 is listed as without effect
    on the reductions, which always overlap backward. ``contiguous_gradients: false`` is
    listed as without effect."""
    overlap = zero.raw("overlap_comm", None)
    if overlap is not None:
        overlap = zero.bool("overlap_comm", False)
        if stage == 2 and not overlap:
            zero.ignored.append(
                (zero.key("overlap_comm"), "flatzero's stage 2 always overlaps reductions")
            )
    if not zero.bool("contiguous_gradients", True):
        zero.ignored.append(
            (zero.key("contiguous_gradients"), "gradients are always staged contiguously")
        )
    return overlap


def parse_zero(top: Section) -> tuple[ZeroSection, int | None, OffloadConfig | None]:
    """``zero_optimization``: the stage, the bucket size its keys ask for
    (``reduce_bucket_size``, else ``allgather_bucket_size``; None when neither is given) and
    the optimizer offload (``offload_optimizer``; None for none)."""
    if "zero_optimization" not in top:
        return ZeroSection(), None, None
    raw = top.raw("zero_optimization", None)
    if isinstance(raw, bool):  # DeepSpeed's legacy form
        return ZeroSection(stage=1 if raw else 0), None, None
    zero = top.section("zero_optimization")
    stage = _read_stage(zero)
    reduce = zero.int("reduce_bucket_size", None, unit=" (elements)")
    gather = zero.int("allgather_bucket_size", None, minimum=0, unit=" (elements)")
    overlap = _note_switches(zero, stage)
    if gather and reduce and gather != reduce:
        zero.ignored.append(
            (
                zero.key("allgather_bucket_size"),
                "flatzero uses one bucket size (reduce_bucket_size) for both collectives",
            )
        )
    offload = parse_offload_optimizer(zero, stage)
    for refusal in ZERO_REFUSED:
        zero.refuse(*refusal)
    check_unused = not zero.bool("ignore_unused_parameters", True)
    if check_unused and offload is None:
        zero.ignored.append(
            (
                zero.key("ignore_unused_parameters"),
                "DeepSpeed checks for params without a gradient only with optimizer offload",
            )
        )
        check_unused = False
    for name, reason in ZERO_NO_EFFECT.items():
        zero.no_effect(name, reason)
    for name in STAGE3_KEYS:
        zero.no_effect(name, "stage 3 only")
    zero.finish(unknown="error", main=ZERO_MAIN_KEYS)
    if overlap and offload is not None:
        zero.ignored.append(
            (zero.key("overlap_comm"), "the offloaded step's parameter gathers do not overlap")
        )
        overlap = None
    return ZeroSection(stage, overlap, check_unused), reduce or gather or None, offload


class _Fp16(NamedTuple):
    """The ``fp16`` section as read."""

    section: Section
    enabled: bool
    auto_cast: bool
    static: float
    power: int
    window: int
    hysteresis: int
    consecutive: bool
    min_scale: float


def _read_bf16(top: Section) -> tuple[str, bool, bool]:
    """``(name, enabled, check_grad_overflow)`` of ``bf16`` (or its old name ``bfloat16``)."""
    name = "bf16" if "bf16" in top or "bfloat16" not in top else "bfloat16"
    if name == "bf16":
        top.no_effect("bfloat16", "superseded by bf16")
    bf16 = top.section(name)
    enabled = bf16.bool("enabled", False)
    check = bf16.bool("check_grad_overflow", True)
    bf16.no_effect("immediate_grad_update", "no effect")
    bf16.refuse(
        "bf16_master_weights_and_grads", bool, "it asks for bf16 master weights", "remove it"
    )
    bf16.refuse("bf16_optimizer_states", bool, "it asks for bf16 optimizer states", "remove it")
    bf16.finish(unknown="error")
    return name, enabled, check


def _read_fp16(top: Section) -> _Fp16:
    fp16 = top.section("fp16")
    enabled = fp16.bool("enabled", False)
    auto_cast = fp16.bool("auto_cast", False)
    if auto_cast and not enabled:
        top.ignored.append(("fp16.auto_cast", "fp16 is off"))
    fp16.refuse(
        "fp16_master_weights_and_grads", bool, "it asks for fp16 master weights", "remove it"
    )
    read = _Fp16(
        section=fp16,
        enabled=enabled,
        auto_cast=auto_cast,
        static=fp16.number("loss_scale", 0.0, minimum=0.0),
        power=fp16.int("initial_scale_power", 16, minimum=0, maximum=64),
        window=fp16.int("loss_scale_window", 1000),
        hysteresis=fp16.int("hysteresis", 2),
        consecutive=fp16.bool("consecutive_hysteresis", False),
        min_scale=fp16.number("min_loss_scale", 1.0),
    )
    fp16.finish(unknown="error")
    return read


def _fp16_loss_scale(fp16: _Fp16) -> LossScaleConfig:
    """DeepSpeed's fp16 loss scaler: static (``loss_scale > 0``) or dynamic."""
    if fp16.min_scale <= 0:
        raise fp16.section.fail("min_loss_scale", fp16.min_scale, "it must be > 0", "use 1 or more")
    if fp16.static > 0:
        return LossScaleConfig(
            init_scale=fp16.static,
            dynamic=False,
            min_scale=min(fp16.static, 1.0),
            max_scale=max(fp16.static, 2.0**24),
        )
    init = 2.0**fp16.power
    if fp16.min_scale > init:
        raise fp16.section.fail(
            "min_loss_scale",
            fp16.min_scale,
            f"it is above the initial scale 2**initial_scale_power = {init:g}",
            "lower min_loss_scale or raise initial_scale_power",
        )
    return LossScaleConfig(
        init_scale=init,
        growth_interval=fp16.window,
        hysteresis=fp16.hysteresis,
        min_scale=fp16.min_scale,
        max_scale=max(init, 2.0**64),
        rule="deepspeed",  # DeepSpeed's DynamicLossScaler, step for step
        consecutive_hysteresis=fp16.consecutive,
    )


def parse_precision(top: Section) -> PrecisionSection:
    """``bf16`` and ``fp16``: the training dtype and its loss scaling."""
    bf16_name, bf16_on, check = _read_bf16(top)
    fp16 = _read_fp16(top)
    if fp16.enabled and bf16_on:
        raise ValueError(
            f"config keys 'fp16.enabled' and '{bf16_name}.enabled' are both true: training "
            "runs in one of them; disable one"
        )
    if fp16.enabled:
        return PrecisionSection("fp16", _fp16_loss_scale(fp16), auto_cast=fp16.auto_cast)
    if bf16_on:
        scale = LossScaleConfig(init_scale=1.0, dynamic=False) if check else None
        return PrecisionSection("bf16", scale)
    return PrecisionSection("fp32", None)


def _grad_accum_dtype(
    types: Section, precision: PrecisionSection, stage: int
) -> torch.dtype | None:
    """``grad_accum_dtype`` as ``ZeroConfig.grad_accum_dtype``: fp32 at any stage; the
    training dtype at stages 0 and 1, where it is what flatzero does anyway (``None``).

    Raises:
        UnsupportedFeatureError: another dtype, or the training dtype at stage 2 (flatzero's
            stage 2 sums in the fp32 gradient shard; DeepSpeed would sum in that dtype).
    """
    name = types.choice("grad_accum_dtype", None, tuple(ACCUM_DTYPES))
    if name is None:
        return None
    dtype = ACCUM_DTYPES[name]
    if dtype == torch.float32:
        return dtype
    training = precision.torch_dtype or torch.float32
    fix = "set it to 'fp32' (or remove it)"
    if dtype != training:
        raise types.unsupported(
            "grad_accum_dtype",
            name,
            f"flatzero accumulates gradients in fp32 or in the training dtype "
            f"({dtype_name(training)}, from bf16/fp16.enabled), not in {dtype_name(dtype)}",
            fix,
            f"{dtype_name(dtype)} gradient accumulation",
        )
    if stage == 2:
        raise types.unsupported(
            "grad_accum_dtype",
            name,
            "flatzero's ZeRO stage 2 accumulates gradients in the fp32 gradient shard "
            f"(1/world_size of the model), never in {dtype_name(dtype)}",
            fix,
            f"{dtype_name(dtype)} gradient accumulation at ZeRO stage 2",
        )
    return None


class DataTypes(NamedTuple):
    """``data_types``, parsed."""

    grad_accum_dtype: torch.dtype | None
    """The dtype gradients accumulate in (``ZeroConfig.grad_accum_dtype``)."""
    buffer_dtype: torch.dtype | None
    """The dtype floating-point buffers are cast to; None: they keep theirs (DeepSpeed's
    default: e.g. a rotary ``inv_freq`` stays fp32 under bf16 training)."""


def _buffer_dtype(types: Section, precision: PrecisionSection) -> torch.dtype | None:
    """``buffer_dtype``: DeepSpeed casts the buffers to it, and keeps those of
    ``keep_in_fp32_modules`` in fp32 (with fp16/bf16 training)."""
    name = types.choice("buffer_dtype", None, tuple(ACCUM_DTYPES))
    dtype = None if name is None else ACCUM_DTYPES[name]
    keep = types.raw("keep_in_fp32_modules", None)
    if dtype is not None and keep and precision.torch_dtype is not None:
        raise types.unsupported(
            "keep_in_fp32_modules",
            keep,
            "flatzero does not keep some buffers in fp32 while buffer_dtype casts the rest",
            "remove buffer_dtype (buffers then keep their dtype) or keep_in_fp32_modules",
            "keep_in_fp32_modules with buffer_dtype",
        )
    types.no_effect("keep_in_fp32_modules", "buffers keep their dtype (no buffer_dtype)")
    return dtype


def parse_data_types(top: Section, precision: PrecisionSection, stage: int) -> DataTypes:
    """``data_types``: the dtype gradients accumulate in, as DeepSpeed honours
    ``grad_accum_dtype``, and the buffers' dtype (``buffer_dtype``); the keys without effect
    are listed."""
    types = top.section("data_types")
    parsed = DataTypes(_grad_accum_dtype(types, precision, stage), _buffer_dtype(types, precision))
    for name, reason in DATA_TYPES_NO_EFFECT.items():
        types.no_effect(name, reason)
    types.finish(unknown="ignore")
    return parsed
