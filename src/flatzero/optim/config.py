"""Frozen, validated configuration of ``ZeroOptimizer`` and its fp16 loss scaler."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from .buckets import CHUNK_ALIGNMENT

__all__ = ["LossScaleConfig", "OffloadConfig", "ZeroConfig", "zero_config_for"]

_REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

DEFAULT_REDUCE_STAGING_BYTES = 2**28
"""Default gradient staging budget: 256 MiB (``ZeroConfig.reduce_staging_bytes``)."""

_BYTES = {"unit": " (bytes)"}


def _positive_int(owner: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


def _positive_float(owner: str, name: str, value: object) -> float:
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{owner}.{name} must be a finite number > 0, got {value!r}")
    return float(value)


LOSS_SCALE_RULES = ("torch", "deepspeed")
"""How a dynamic loss scale moves (``LossScaleConfig.rule``)."""


@dataclass(frozen=True)
class LossScaleConfig:
    """Dynamic loss scaling for fp16 params.

    The loss is multiplied by ``scale`` before backward (``ZeroOptimizer.scale_loss``); the
    step divides the gradients by it. If any gradient element on any rank is inf or nan,
    every rank skips the step (parameters and optimizer state unchanged). How the scale
    moves is the ``rule``:

    - ``"torch"`` (``torch.amp.GradScaler``'s, with a hysteresis): after ``hysteresis``
      consecutive overflows, ``scale`` is multiplied by ``backoff_factor`` (never below
      ``min_scale``) and the hysteresis refills; after ``growth_interval`` steps in a row
      without overflow it is multiplied by ``growth_factor`` (never above ``max_scale``).
    - ``"deepspeed"`` (DeepSpeed's ``DynamicLossScaler``, step for step; the DeepSpeed door
      uses it): an overflow spends one unit of hysteresis, or halves the scale once only one
      is left, and the hysteresis is not refilled then, so every further overflow halves it;
      a clean step refills it when ``consecutive_hysteresis``; the scale grows when the steps
      since the last overflow, less one, are a positive multiple of ``growth_interval``
      (which also refills the hysteresis without ``consecutive_hysteresis``).

    Attributes:
        init_scale: the first scale (dimensionless multiplier of the loss).
        growth_factor: factor (> 1) applied after ``growth_interval`` clean steps.
        backoff_factor: factor (in (0, 1)) applied on overflow.
        growth_interval: clean steps (optimizer steps, not micro-batches) between growths.
        hysteresis: consecutive overflowing steps before the scale backs off (DeepSpeed's
            ``hysteresis``; 1 backs off at every overflow, as torch does). Every
            overflowing step is skipped regardless.
        min_scale: lower bound of the scale.
        max_scale: upper bound of the scale.
        dynamic: ``False`` keeps ``init_scale`` forever (a static scale); overflowing steps
            are still skipped.
        rule: ``"torch"`` or ``"deepspeed"`` (above).
        consecutive_hysteresis: (``"deepspeed"`` rule) refill the hysteresis after every
            step without overflow.
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 1
    min_scale: float = 1.0
    max_scale: float = 2.0**24
    dynamic: bool = True
    rule: str = "torch"
    consecutive_hysteresis: bool = False

    def __post_init__(self) -> None:
        owner = "LossScaleConfig"
        if self.rule not in LOSS_SCALE_RULES:
            raise ValueError(
                f"{owner}.rule must be one of {', '.join(LOSS_SCALE_RULES)}, got {self.rule!r}"
            )
        for name in ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
            object.__setattr__(self, name, _positive_float(owner, name, getattr(self, name)))
        _positive_int(owner, "growth_interval", self.growth_interval)
        _positive_int(owner, "hysteresis", self.hysteresis)
        if self.growth_factor <= 1.0:
            raise ValueError(f"{owner}.growth_factor must be > 1, got {self.growth_factor}")
        if self.backoff_factor >= 1.0:
            raise ValueError(f"{owner}.backoff_factor must be < 1, got {self.backoff_factor}")
        if not self.min_scale <= self.init_scale <= self.max_scale:
            raise ValueError(
                f"{owner}: need min_scale <= init_scale <= max_scale, got {self.min_scale}, "
                f"{self.init_scale}, {self.max_scale}"
            )
        if not isinstance(self.dynamic, bool):
            raise ValueError(f"{owner}.dynamic must be a bool, got {self.dynamic!r}")


@dataclass(frozen=True)
class OffloadConfig:
    """Optimizer offload (ZeRO-Offload, DeepSpeed's ``offload_optimizer: {device: cpu}``):
    the optimizer steps in host memory.

    This rank's fp32 master shard, the inner optimizer's state and a host fp32 gradient
    shard live in host memory; the reduced gradient shard is copied to the host bucket by
    bucket (its own stream, an event per bucket), the inner optimizer steps there with
    torch's fused CPU kernel where it has one, and the updated shard is cast to the params'
    dtype and uploaded into this rank's slice of every bucket before the all-gather. Not to
    be confused with the flatten tier ``host_park`` (params parked in host memory during init).

    Attributes:
        pin_memory: page-lock the host gradient shard (also the upload's source), so that
            the copies to and from the accelerator are asynchronous; where pinning fails,
            pageable memory with one warning (synchronous copies: slower, never wrong).
            Without an accelerator nothing is pinned.
        threads: intra-op CPU threads of the host step; ``None``: the rank's share of its
            host's cores (usable cores over the ranks on the host, as init uses).
    """

    pin_memory: bool = True
    threads: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise ValueError(
                f"OffloadConfig.pin_memory must be True or False, got {self.pin_memory!r}"
            )
        if self.threads is not None:
            _positive_int("OffloadConfig", "threads", self.threads)


@dataclass(frozen=True)
class ZeroConfig:
    """How ``ZeroOptimizer`` reduces gradients and steps.

    Attributes:
        stage: ZeRO stage. 1: full gradients live in one flat buffer per group (params'
            ``.grad`` are views of it unless ``grad_accum_dtype`` differs from their dtype),
            reduced at ``step()``. 2: during backward each gradient leaves its param and
            is staged chunk by chunk; every complete chunk is reduced asynchronously into
            its owner's fp32 gradient shard.
        max_grad_norm: clip the global L2 norm of the (averaged, unscaled) gradient to this
            value at every step, as ``torch.nn.utils.clip_grad_norm_`` does; ``None`` does
            not clip (``ZeroOptimizer.clip_grad_norm_`` can still be called by hand).
        reduce_dtype: dtype the gradients are summed over ranks in. ``torch.float32`` (the
            default) sums exactly what a single process would; the params' dtype halves the
            bytes on the wire for bf16/fp16 at the cost of low-precision sums.
        grad_accum_dtype: dtype each rank sums its gradients in over the backward passes of
            an accumulation window, before they are reduced over ranks (DeepSpeed's
            ``data_types.grad_accum_dtype``). ``None``: stage 1 sums in the params' dtype
            (autograd adds into the flat gradient buffer the params' ``.grad`` view);
            stage 2 sums in the fp32 gradient shard. ``torch.float32``: stage 1 keeps the
            flat gradient buffer of a bf16/fp16 group in fp32 (4 bytes per element instead
            of 2) and its hooks add each param's gradient into it as it arrives and free
            ``.grad`` (those params hold no ``.grad`` after backward, as in stage 2); stage 2
            is unchanged. No other dtype.
        staging_buffers: the fewest chunks ``reduce_staging_bytes`` is cut into, so that
            this many reductions can be in flight at once (2 overlaps staging one chunk
            with reducing the previous one).
        reduce_staging_bytes: the most memory gradient staging ever holds, in bytes (in
            ``reduce_dtype``; default 256 MiB). Gradients are reduced in chunks of at most
            ``reduce_staging_bytes / staging_buffers`` bytes and one rank's slice of a
            bucket (a larger param is reduced in several); the staging pool holds as many
            chunk-sized slots as fit. The counterpart of DeepSpeed's ``reduce_bucket_size``
            (which flatzero's DeepSpeed door maps to the bucket size instead).
        loss_scale: fp16 loss scaling; ``None`` enables the defaults when any param is fp16
            and disables scaling otherwise. Scaling with no fp16 param is allowed.
        learn_bucket_order: record in which order buckets get their last gradient during
            the first backward pass and, from the first step on, launch reductions in that order
            (rank 0's, agreed by all ranks). Reductions are always launched in one order
            agreed by all ranks; this only makes it the one backward actually follows.
        offload_optimizer: step the optimizer in host memory (``OffloadConfig``); ``None``
            keeps the master shards and the optimizer state beside the buckets.
        check_gradients: verify every reduction of every step (``grad_check.py``): each rank
            projects what it contributes to each chunk on a seeded random vector, each owner
            projects what landed in its shard, one all-reduce of a few scalars per chunk
            compares them; a mismatch raises ``GradientMismatch`` naming the bucket, the
            params and the ranks. Off by default; over several ranks only.
        overlap_param_gather: ``step()`` launches the parameter all-gathers and returns;
            the next forward waits for each bucket's just before a module owning its
            params runs (``optim/overlap.py``). Needs the model (``ZeroOptimizer(model)``
            or ``ZeroOptimizer.overlap_with(model)``) and no optimizer offload. ``None``
            (the default): off; ``True``: on (an error without the model); ``False``: off.
            Torch ops of the training thread that read params between ``step()`` and the
            next forward wait for their buckets' gathers ([Note: reads between step and
            forward]).
        overlap_guard: debug mode of ``overlap_param_gather``: from ``step()`` until every
            gather was waited for, any torch op reading a param whose gather is still
            running raises ``RuntimeError`` instead of waiting (costs a check per op
            meanwhile).
    """

    stage: int = 2
    max_grad_norm: float | None = None
    reduce_dtype: torch.dtype = torch.float32
    grad_accum_dtype: torch.dtype | None = None
    staging_buffers: int = 2
    reduce_staging_bytes: int = field(default=DEFAULT_REDUCE_STAGING_BYTES, metadata=_BYTES)
    loss_scale: LossScaleConfig | None = None
    learn_bucket_order: bool = True
    offload_optimizer: OffloadConfig | None = None
    check_gradients: bool = False
    overlap_param_gather: bool | None = None
    overlap_guard: bool = False

    def __post_init__(self) -> None:
        if self.stage not in (1, 2) or isinstance(self.stage, bool):
            raise ValueError(
                f"ZeroConfig.stage is {self.stage!r}; flatzero implements ZeRO stage 1 and 2: "
                "pass stage=1 or stage=2"
            )
        if self.max_grad_norm is not None:
            object.__setattr__(
                self,
                "max_grad_norm",
                _positive_float("ZeroConfig", "max_grad_norm", self.max_grad_norm),
            )
        if self.reduce_dtype not in _REDUCE_DTYPES:
            raise ValueError(
                f"ZeroConfig.reduce_dtype is {self.reduce_dtype!r}; use torch.float32, "
                "torch.bfloat16 or torch.float16"
            )
        if self.grad_accum_dtype not in (None, torch.float32):
            raise ValueError(
                f"ZeroConfig.grad_accum_dtype is {self.grad_accum_dtype!r}; gradients accumulate "
                "in the params' dtype (None) or in fp32: pass None or torch.float32"
            )
        _positive_int("ZeroConfig", "staging_buffers", self.staging_buffers)
        _positive_int("ZeroConfig", "reduce_staging_bytes", self.reduce_staging_bytes)
        least = self.staging_buffers * CHUNK_ALIGNMENT * self.reduce_dtype.itemsize
        if self.reduce_staging_bytes < least:
            raise ValueError(
                f"ZeroConfig.reduce_staging_bytes is {self.reduce_staging_bytes}; it must hold "
                f"staging_buffers={self.staging_buffers} chunks of at least {CHUNK_ALIGNMENT} "
                f"elements: at least {least} bytes"
            )
        if self.loss_scale is not None and not isinstance(self.loss_scale, LossScaleConfig):
            raise TypeError(
                f"ZeroConfig.loss_scale must be a LossScaleConfig or None, got "
                f"{type(self.loss_scale).__name__}"
            )
        if not isinstance(self.learn_bucket_order, bool):
            raise ValueError(
                f"ZeroConfig.learn_bucket_order must be a bool, got {self.learn_bucket_order!r}"
            )
        if not isinstance(self.check_gradients, bool):
            raise ValueError(
                f"ZeroConfig.check_gradients must be a bool, got {self.check_gradients!r}"
            )
        if self.offload_optimizer is not None and not isinstance(
            self.offload_optimizer, OffloadConfig
        ):
            raise TypeError(
                f"ZeroConfig.offload_optimizer must be an OffloadConfig or None, got "
                f"{type(self.offload_optimizer).__name__}; pass OffloadConfig(pin_memory=...)"
            )

    def accumulation_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype stage 1 sums the gradients of params of ``param_dtype`` in over an
        accumulation window (``grad_accum_dtype``, else ``param_dtype``)."""
        return param_dtype if self.grad_accum_dtype is None else self.grad_accum_dtype


def zero_config_for(
    config: ZeroConfig | None, stage: int | None, offload: bool | OffloadConfig | None
) -> ZeroConfig:
    """``ZeroOptimizer``'s config from its arguments: ``config`` (default ``ZeroConfig()``)
    with ``stage`` when given and ``offload_optimizer`` from ``offload`` (``True``:
    ``OffloadConfig()``; ``False``: off; ``None``: as ``config`` says)."""
    config = config or ZeroConfig()
    if not isinstance(config, ZeroConfig):
        raise TypeError(f"config must be a ZeroConfig, got {type(config).__name__}")
    if stage is not None and stage != config.stage:
        config = dataclasses.replace(config, stage=stage)
    if offload is None:
        return config
    if isinstance(offload, bool):
        offload = OffloadConfig() if offload else None
    elif not isinstance(offload, OffloadConfig):
        raise TypeError(
            f"offload_optimizer must be True, False, None or an OffloadConfig, got "
            f"{type(offload).__name__}; pass offload_optimizer=True or OffloadConfig(...)"
        )
    return dataclasses.replace(config, offload_optimizer=offload)
