"""The DeepSpeed config of ``flatzero.initialize``, parsed once into frozen dataclasses.

``parse_config(config, world_size=...)`` reads a DeepSpeed config (a dict, or the path of a
JSON file) and returns an ``EngineConfig``; nothing else in flatzero reads the dict. Every
key falls in one of three kinds:

- implemented: parsed, validated and used (batch sizes, ``zero_optimization`` stage 0-2
  and bucket sizes, ``bf16``, ``fp16``, ``optimizer``, ``scheduler``,
  ``gradient_clipping``, ``steps_per_print``, ``communication_data_type``, the
  ``flatzero`` section);
- without effect here: accepted and listed in ``EngineConfig.ignored`` (monitors,
  profilers, stage-3 tuning keys under stage 1/2, switches flatzero always has on, ...);
  ``initialize`` logs them once in one warning;
- asking for something DeepSpeed has and flatzero does not implement (stage 3, offload,
  quantized or hierarchical ZeRO, torch autocast, pipeline or tensor parallelism, optimizer
  types other than Adam/AdamW/SGD, ...): an ``UnsupportedFeatureError`` (a ``ValueError``)
  naming the key, its value and the fix; ``flatzero.patch_deepspeed()`` hands such configs
  to the real DeepSpeed.

Everything else that is wrong is a user error (``ValueError``/``TypeError``): an unknown key
inside a section flatzero parses (as DeepSpeed's own validation does), a bad type or value,
inconsistent batch sizes, and any ``"auto"`` value where a value has an effect (``"auto"``
is the Hugging Face Trainer's placeholder; the Trainer replaces it before it calls
``deepspeed.initialize``). ``steps_per_print`` may be ``inf`` (Accelerate's "never").

The batch sizes follow DeepSpeed's rule: ``train_batch_size = train_micro_batch_size_per_gpu
* gradient_accumulation_steps * world_size``; any two determine the third (with DeepSpeed's
integer divisions), one alone sets ``gradient_accumulation_steps = 1``, and the three must
then agree exactly.
"""

from __future__ import annotations

import inspect
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from ..config import DEFAULT_BUCKET_NUMEL, TIERS, FlattenConfig
from ..optim import LossScaleConfig, ZeroConfig
from .errors import UnsupportedFeatureError
from .schedulers import SCHEDULERS

__all__ = [
    "PARAM_SYNC",
    "BatchConfig",
    "EngineConfig",
    "FlatzeroSection",
    "OptimizerSection",
    "PrecisionSection",
    "SchedulerSection",
    "ZeroSection",
    "load_config_dict",
    "parse_config",
]

PARAM_SYNC = ("gather", "check", "none")
"""``flatzero.param_sync`` choices: how ranks agree on the initial weights."""

_MISSING = object()
_AUTO_FIX = (
    "'auto' is a placeholder that the Hugging Face Trainer fills in before it calls "
    "deepspeed.initialize; flatzero.initialize needs the value itself: write the number "
    "(or remove the key to take DeepSpeed's default)"
)
_COMM_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "bfp16": torch.bfloat16,
}
_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _fmt(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _Section:
    """One JSON object of the config: typed reads by key, with the key path in errors."""

    def __init__(self, data: Any, path: str, ignored: list[tuple[str, str]]) -> None:
        if not isinstance(data, Mapping):
            raise TypeError(
                f"config key {path!r} must be a JSON object (dict), got "
                f"{type(data).__name__} {_fmt(data)}"
            )
        self.data = data
        self.path = path
        self.ignored = ignored
        self.used: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def __contains__(self, name: str) -> bool:
        self.used.add(name)  # asked about: a key this parser knows
        return name in self.data

    def raw(self, name: str, default: Any = _MISSING, *, auto_ok: bool = False) -> Any:
        self.used.add(name)
        value = self.data.get(name, default)
        if not auto_ok and name in self.data and isinstance(value, str) and value == "auto":
            raise ValueError(f"config key {self.key(name)!r} is 'auto': {_AUTO_FIX}")
        return value

    def fail(self, name: str, value: Any, rule: str, fix: str) -> ValueError:
        return ValueError(f"config key {self.key(name)!r} is {_fmt(value)}: {rule}; {fix}")

    def unsupported(
        self, name: str, value: Any, rule: str, fix: str, feature: str
    ) -> UnsupportedFeatureError:
        """The error for a value asking for a DeepSpeed feature flatzero lacks."""
        return UnsupportedFeatureError(
            f"config key {self.key(name)!r} is {_fmt(value)}: {rule}; {fix}",
            key=self.key(name),
            feature=feature,
        )

    def int(self, name: str, default: Any, *, minimum: int = 1, unit: str = "") -> Any:
        value = self.raw(name, default)
        if value is None or value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(
                f"config key {self.key(name)!r} must be an integer{unit}, got "
                f"{type(value).__name__} {_fmt(value)}"
            )
        if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
            raise self.fail(name, value, f"it must be a whole number{unit}", "write an integer")
        if value < minimum:
            raise self.fail(
                name, value, f"it must be >= {minimum}{unit}", f"use a value >= {minimum}"
            )
        return int(value)

    def number(self, name: str, default: Any, *, minimum: float | None = None) -> Any:
        value = self.raw(name, default)
        if value is None or value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(
                f"config key {self.key(name)!r} must be a number, got "
                f"{type(value).__name__} {_fmt(value)}"
            )
        if not math.isfinite(value):
            raise self.fail(name, value, "it must be finite", "write a finite number")
        if minimum is not None and value < minimum:
            raise self.fail(
                name, value, f"it must be >= {minimum:g}", f"use a value >= {minimum:g}"
            )
        return float(value)

    def bool(self, name: str, default: bool) -> bool:
        value = self.raw(name, default)
        if not isinstance(value, bool):
            raise TypeError(
                f"config key {self.key(name)!r} must be true or false, got "
                f"{type(value).__name__} {_fmt(value)}"
            )
        return value

    def choice(self, name: str, default: Any, choices: tuple[str, ...]) -> Any:
        value = self.raw(name, default, auto_ok="auto" in choices)
        if value is default:
            return value
        if value not in choices:
            raise self.fail(
                name,
                value,
                f"it must be one of {', '.join(map(repr, choices))}",
                "pick one of them",
            )
        return value

    def section(self, name: str) -> _Section:
        value = self.raw(name, {})
        return _Section({} if value is None else value, self.key(name), self.ignored)

    def no_effect(self, name: str, reason: str) -> None:
        """``name``, when present, is accepted and listed as having no effect."""
        self.used.add(name)
        if name in self.data:
            self.ignored.append((self.key(name), reason))

    def refuse(self, name: str, active: Callable[[Any], bool], what: str, fix: str) -> None:
        """``name`` is an ``UnsupportedFeatureError`` when present with a value ``active``
        says asks for ``what`` (``"it asks for X"``); otherwise (off, default, ``"none"``) it
        is accepted as without effect."""
        self.used.add(name)
        if name not in self.data:
            return
        value = self.data[name]
        if active(value):
            raise self.unsupported(
                name,
                value,
                f"{what}, which flatzero does not implement",
                fix,
                what.removeprefix("it asks ").removeprefix("for ").removeprefix("to "),
            )
        self.ignored.append((self.key(name), "off; no effect"))

    def finish(self, *, unknown: str, main: tuple[str, ...] | None = None) -> None:
        """Handle keys nobody read: ``unknown="error"`` or ``"ignore"`` (listed). An error
        lists the known keys (or ``main`` ones, for a long list)."""
        for name in self.data:
            if name in self.used:
                continue
            if unknown == "error":
                known = ", ".join(main) + ", ..." if main else ", ".join(sorted(self.used))
                raise ValueError(
                    f"config key {self.key(name)!r} is not a key of {self.path!r} that "
                    f"DeepSpeed or flatzero knows (known: {known}); fix its spelling or "
                    "remove it"
                )
            self.ignored.append((self.key(name), "unknown key; no effect"))


def _enabled(value: Any) -> bool:
    """A feature section (``{"enabled": true, ...}``) or flag that is switched on."""
    if isinstance(value, Mapping):
        return bool(value.get("enabled", False))
    return bool(value)


def _compile_on(value: Any) -> bool:
    if isinstance(value, Mapping):
        return bool(value.get("deepcompile", False)) or bool(value.get("enabled", False))
    return bool(value)


def _offload_active(value: Any) -> bool:
    if value is None:
        return False
    if isinstance(value, Mapping):
        return str(value.get("device", "none")).lower() not in ("none", "")
    return bool(value)


# ----------------------------------------------------------------------- sections
@dataclass(frozen=True)
class BatchConfig:
    """Batch sizes, resolved with DeepSpeed's rule for this world size.

    Attributes:
        train_batch_size: samples per optimizer step over all ranks.
        micro_batch_per_gpu: samples per forward/backward on one rank.
        gradient_accumulation_steps: micro-batches per optimizer step on each rank.
        world_size: data-parallel ranks the rule was applied with.
    """

    train_batch_size: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int
    world_size: int

    def __post_init__(self) -> None:
        for name in ("train_batch_size", "micro_batch_per_gpu", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BatchConfig.{name} must be a positive int, got {value!r}")
        product = self.micro_batch_per_gpu * self.gradient_accumulation_steps * self.world_size
        if self.train_batch_size != product:
            raise ValueError(
                f"train_batch_size ({self.train_batch_size}) must equal "
                f"train_micro_batch_size_per_gpu ({self.micro_batch_per_gpu}) * "
                f"gradient_accumulation_steps ({self.gradient_accumulation_steps}) * world size "
                f"({self.world_size}) = {product}; fix one of them, or give only two and let "
                "the third be derived"
            )


@dataclass(frozen=True)
class ZeroSection:
    """``zero_optimization``.

    Attributes:
        stage: 0 (plain data parallel: all-reduced gradients, replicated optimizer state),
            1 (sharded optimizer state) or 2 (sharded gradients too).
        reduce_bucket_size: ``reduce_bucket_size`` as given (elements), or None.
        allgather_bucket_size: ``allgather_bucket_size`` as given (elements), or None.
        overlap_comm: as given, or None. flatzero's stage 2 always overlaps reductions
            with backward; stages 0 and 1 reduce at the accumulation boundary.
        contiguous_gradients: as given (flatzero always stages gradients contiguously).
    """

    stage: int = 0
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    overlap_comm: bool | None = None
    contiguous_gradients: bool = True

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2) or isinstance(self.stage, bool):
            raise ValueError(f"ZeroSection.stage must be 0, 1 or 2, got {self.stage!r}")


@dataclass(frozen=True)
class PrecisionSection:
    """``bf16`` / ``fp16``: the training dtype of the params and the loss scaling.

    Attributes:
        dtype: ``"fp32"`` (keep the model's dtypes), ``"bf16"`` or ``"fp16"``: the dtype
            trainable params are cast to while they are flattened.
        loss_scale: the loss scaler (fp16; or a fixed scale of 1 for bf16 with
            ``check_grad_overflow``, which skips steps whose gradients hold inf/nan, as
            DeepSpeed does), or None.
        auto_cast: ``fp16.auto_cast``: the engine's forward casts floating-point
            positional inputs to fp16, as DeepSpeed's does (fp16 only).
    """

    dtype: str = "fp32"
    loss_scale: LossScaleConfig | None = None
    auto_cast: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_NAMES:
            raise ValueError(f"PrecisionSection.dtype must be fp32, bf16 or fp16: {self.dtype!r}")
        if self.auto_cast and self.dtype != "fp16":
            raise ValueError(f"PrecisionSection.auto_cast needs dtype fp16, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The params' dtype, or None for fp32 (each param keeps its dtype)."""
        return None if self.dtype == "fp32" else getattr(torch, _DTYPE_NAMES[self.dtype])


@dataclass(frozen=True)
class OptimizerSection:
    """``optimizer``: which ``torch.optim`` class runs on the flat shards, and its args.

    Attributes:
        type: the config's ``type`` as written (``"AdamW"``, ``"adam"``, ``"SGD"``).
        torch_name: the ``torch.optim`` class: ``"AdamW"`` (DeepSpeed's ``Adam`` with its
            default ``adam_w_mode: true``, and ``AdamW``), ``"Adam"`` or ``"SGD"``.
        params: keyword arguments of that class (lr, betas, eps, weight_decay, ...), with
            DeepSpeed's defaults for keys it sets differently from torch.
    """

    type: str
    torch_name: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.torch_name not in ("AdamW", "Adam", "SGD"):
            raise ValueError(f"OptimizerSection.torch_name {self.torch_name!r} is not supported")
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    @property
    def torch_class(self) -> type[torch.optim.Optimizer]:
        """The ``torch.optim`` class."""
        return getattr(torch.optim, self.torch_name)

    def kwargs(self) -> dict[str, Any]:
        """A fresh dict of the keyword arguments."""
        return dict(self.params)


@dataclass(frozen=True)
class SchedulerSection:
    """``scheduler``: a DeepSpeed warmup schedule or a ``torch.optim.lr_scheduler`` class.

    Attributes:
        type: ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR`` (flatzero's own, same
            numbers as DeepSpeed's) or the name of a ``torch.optim.lr_scheduler`` class.
        params: its keyword arguments.
    """

    type: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    @property
    def scheduler_class(self) -> type:
        """The scheduler class."""
        return SCHEDULERS.get(self.type) or getattr(torch.optim.lr_scheduler, self.type)

    def kwargs(self) -> dict[str, Any]:
        """A fresh dict of the keyword arguments (lists stay lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.params.items()}


@dataclass(frozen=True)
class FlatzeroSection:
    """The ``flatzero`` section: what DeepSpeed's config has no words for.

    Attributes:
        tier: flatten tier (``FlattenConfig.tier``): ``auto``, ``device``, ``host``,
            ``sharded``, ``offload`` or ``cpu``.
        bucket_numel: bucket size in elements; overrides ``reduce_bucket_size``.
        device: where the flat buffers live (``"cuda:0"``, ``"cpu"``); None: the current
            GPU, else the CPU.
        host_threads: CPU threads per rank while flattening; None: cores / local ranks.
        staging_buffers: pinned staging buffers of the ``host``/``sharded`` tiers.
        reduce_staging_buffers: stage 2 gradient staging buffers (``ZeroConfig``).
        learn_bucket_order: launch reductions in the order backward completes buckets.
        param_sync: how ranks agree on the initial weights after flattening: ``gather``
            (each rank's slice of every bucket is all-gathered, so all ranks hold the same
            weights, as DeepSpeed's broadcast from rank 0 ensures; stage 0 broadcasts from
            rank 0), ``check`` (compare a checksum, raise if ranks differ) or ``none``.
            Skipped when the flatten tier already all-gathered (``sharded``).
        progress: progress bar on rank 0 for long inits.
        elementwise_optimizer: vouch that a client optimizer class flatzero does not know
            is elementwise (``ZeroOptimizer(elementwise_optimizer=True)``).
    """

    tier: str = "auto"
    bucket_numel: int | None = None
    device: str | None = None
    host_threads: int | None = None
    staging_buffers: int = 2
    reduce_staging_buffers: int = 2
    learn_bucket_order: bool = True
    param_sync: str = "gather"
    progress: bool = True
    elementwise_optimizer: bool = False

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"FlatzeroSection.tier must be one of {TIERS}, got {self.tier!r}")
        if self.param_sync not in PARAM_SYNC:
            raise ValueError(
                f"FlatzeroSection.param_sync must be one of {PARAM_SYNC}, got {self.param_sync!r}"
            )


@dataclass(frozen=True)
class EngineConfig:
    """A parsed DeepSpeed config: everything ``flatzero.initialize`` and the engine use.

    Attributes:
        batch: batch sizes (resolved).
        zero: the ``zero_optimization`` section.
        precision: training dtype and loss scaling.
        optimizer: the ``optimizer`` section, or None (a client optimizer must be passed).
        scheduler: the ``scheduler`` section, or None.
        gradient_clipping: max global L2 norm of the gradient, or None (0 in the config).
        steps_per_print: log progress every this many optimizer steps (None: never; the
            config's ``null`` or ``inf``).
        reduce_dtype: dtype gradients are summed over ranks in (``communication_data_type``;
            default float32).
        dataloader_drop_last: ``drop_last`` of the data loader built from ``training_data``.
        flatzero: the ``flatzero`` section.
        ignored: ``(key, reason)`` of every key accepted without effect, in config order.
        source: the config as given (read-only).
    """

    batch: BatchConfig
    zero: ZeroSection = ZeroSection()
    precision: PrecisionSection = PrecisionSection()
    optimizer: OptimizerSection | None = None
    scheduler: SchedulerSection | None = None
    gradient_clipping: float | None = None
    steps_per_print: int | None = 10
    reduce_dtype: torch.dtype = torch.float32
    dataloader_drop_last: bool = False
    flatzero: FlatzeroSection = FlatzeroSection()
    ignored: tuple[tuple[str, str], ...] = ()
    source: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.gradient_clipping is not None and not self.gradient_clipping > 0:
            raise ValueError(
                f"EngineConfig.gradient_clipping must be > 0 or None, got {self.gradient_clipping}"
            )
        if self.steps_per_print is not None and self.steps_per_print < 1:
            raise ValueError(
                f"EngineConfig.steps_per_print must be >= 1 or None, got {self.steps_per_print}"
            )
        object.__setattr__(self, "source", MappingProxyType(dict(self.source)))

    @property
    def bucket_numel(self) -> int:
        """Bucket size in elements: ``flatzero.bucket_numel``, else ``reduce_bucket_size``,
        else ``allgather_bucket_size``, else flatzero's default (64 Mi elements)."""
        for value in (
            self.flatzero.bucket_numel,
            self.zero.reduce_bucket_size,
            self.zero.allgather_bucket_size,
        ):
            if value:
                return value
        return DEFAULT_BUCKET_NUMEL

    def flatten_config(self) -> FlattenConfig:
        """The ``FlattenConfig`` of the model's flat buffers."""
        dtype = self.precision.torch_dtype
        return FlattenConfig(
            tier=self.flatzero.tier,
            device=self.flatzero.device,
            bucket_numel=self.bucket_numel,
            staging_buffers=self.flatzero.staging_buffers,
            host_threads=self.flatzero.host_threads,
            progress=self.flatzero.progress,
            dtype=None if dtype is None else str(dtype),
        )

    def zero_config(self) -> ZeroConfig:
        """The ``ZeroConfig`` of the optimizer (stage 0 runs as a stage 1 optimizer over
        a one-rank group, with gradients all-reduced by the engine)."""
        return ZeroConfig(
            stage=max(1, self.zero.stage),
            max_grad_norm=self.gradient_clipping,
            reduce_dtype=self.reduce_dtype,
            staging_buffers=self.flatzero.reduce_staging_buffers,
            loss_scale=self.precision.loss_scale,
            learn_bucket_order=self.flatzero.learn_bucket_order,
        )

    def ignored_summary(self) -> str:
        """One line listing the keys without effect (empty when there are none)."""
        return "; ".join(f"{key} ({reason})" for key, reason in self.ignored)


# ------------------------------------------------------------------------ parsing
def load_config_dict(config: Any) -> dict[str, Any]:
    """The config as a dict: a mapping (copied), or the path of a JSON file."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ValueError(
                f"config file {path!r} does not exist; pass a dict or the path of a DeepSpeed "
                "JSON config"
            ) from None
        except json.JSONDecodeError as error:
            raise ValueError(f"config file {path!r} is not valid JSON: {error}") from error
        if not isinstance(data, dict):
            raise TypeError(f"config file {path!r} must hold a JSON object, not a {type(data)}")
        return data
    raise TypeError(
        f"config must be a dict or the path of a JSON file, got {type(config).__name__}"
    )


def _parse_batch(top: _Section, world_size: int) -> BatchConfig:
    train = top.int("train_batch_size", None)
    micro = top.int("train_micro_batch_size_per_gpu", None)
    gas = top.int("gradient_accumulation_steps", None)
    # DeepSpeed's _set_batch_related_parameters, with its integer divisions.
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


_STAGE3_KEYS = (
    "stage3_prefetch_bucket_size",
    "prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "param_persistence_threshold",
    "stage3_model_persistence_threshold",
    "model_persistence_threshold",
    "stage3_max_live_parameters",
    "max_live_parameters",
    "stage3_max_reuse_distance",
    "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "stage3_module_granularity_threshold",
    "module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params",
    "use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential",
    "allgather_sequential",
    "sub_group_size",
    "memory_efficient_linear",
    "override_module_apply",
    "leaf_module",
    "log_trace_cache_warnings",
    "enable_sanity_checks",
    "pipeline_loading_checkpoint",
    "zero_quantized_nontrainable_weights",
)
_ZERO_NO_EFFECT = {
    "reduce_scatter": "flatzero always reduce-scatters",
    "allgather_partitions": "flatzero always all-gathers updated buckets",
    "use_multi_rank_bucket_allreduce": "no effect",
    "round_robin_gradients": "no effect",
    "ignore_unused_parameters": "unused params count as zero gradients",
    "load_from_fp32_weights": "checkpoints always hold fp32 master weights",
    "elastic_checkpoint": "checkpoints always load at any world size",
    "compute_grad_norm": "the norm is computed when clipping or loss scaling needs it",
    "parameter_alignment": "params are always aligned to 64 elements",
    "cpu_offload_use_pin_memory": "no offload",
    "save_muon_momentum_buffer_in_memory": "no Muon",
    "ratio": "no offload",
}


def _parse_zero(top: _Section) -> ZeroSection:
    raw = top.raw("zero_optimization", None)
    if raw is None:
        return ZeroSection()
    if isinstance(raw, bool):  # DeepSpeed's legacy form
        return ZeroSection(stage=1 if raw else 0)
    zero = top.section("zero_optimization")
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
    reduce = zero.int("reduce_bucket_size", None, unit=" (elements)")
    gather = zero.int("allgather_bucket_size", None, minimum=0, unit=" (elements)")
    overlap = zero.raw("overlap_comm", None)
    if overlap is not None:
        overlap = zero.bool("overlap_comm", False)
        if stage == 2 and not overlap:
            zero.ignored.append(
                (zero.key("overlap_comm"), "flatzero's stage 2 always overlaps reductions")
            )
        if stage < 2 and overlap:
            zero.ignored.append(
                (zero.key("overlap_comm"), "stages 0/1 reduce at the accumulation boundary")
            )
    contiguous = zero.bool("contiguous_gradients", True)
    if not contiguous:
        zero.ignored.append(
            (zero.key("contiguous_gradients"), "gradients are always staged contiguously")
        )
    if gather and reduce and gather != reduce:
        zero.ignored.append(
            (
                zero.key("allgather_bucket_size"),
                "flatzero uses one bucket size (reduce_bucket_size) for both collectives",
            )
        )
    fix_offload = "remove it (or set its device to 'none'); flatzero keeps everything on device"
    zero.refuse(
        "offload_optimizer", _offload_active, "it asks to offload the optimizer", fix_offload
    )
    zero.refuse("offload_param", _offload_active, "it asks to offload the params", fix_offload)
    zero.refuse("cpu_offload", bool, "it asks to offload the optimizer", fix_offload)
    zero.refuse("cpu_offload_param", bool, "it asks to offload the params", fix_offload)
    zero.refuse(
        "zero_hpz_partition_size",
        lambda v: v not in (0, 1),
        "it asks for hierarchical partitioning (ZeRO++)",
        "remove it",
    )
    zero.refuse(
        "mics_shard_size", lambda v: v not in (-1, 0, None), "it asks for MiCS", "remove it"
    )
    zero.refuse(
        "mics_hierarchical_params_gather", bool, "it asks for MiCS hierarchical gather", "remove it"
    )
    zero.refuse(
        "zero_quantized_weights", bool, "it asks for quantized weights (ZeRO++)", "remove it"
    )
    zero.refuse(
        "zero_quantized_gradients", bool, "it asks for quantized gradients (ZeRO++)", "remove it"
    )
    zero.refuse("zenflow", lambda v: v is not None, "it asks for ZenFlow", "remove it")
    zero.refuse("legacy_stage1", bool, "it asks for DeepSpeed's legacy stage 1", "remove it")
    for name, reason in _ZERO_NO_EFFECT.items():
        zero.no_effect(name, reason)
    for name in _STAGE3_KEYS:
        zero.no_effect(name, "stage 3 only")
    zero.finish(
        unknown="error",
        main=(
            "stage",
            "reduce_bucket_size",
            "allgather_bucket_size",
            "overlap_comm",
            "contiguous_gradients",
            "offload_optimizer",
            "offload_param",
            "stage3_*",
        ),
    )
    return ZeroSection(stage, reduce, gather, overlap, contiguous)


def _parse_precision(top: _Section) -> PrecisionSection:
    bf16_name = "bf16" if "bf16" in top or "bfloat16" not in top else "bfloat16"
    if bf16_name == "bf16":
        top.no_effect("bfloat16", "superseded by bf16")
    bf16 = top.section(bf16_name)
    bf16_on = bf16.bool("enabled", False)
    check = bf16.bool("check_grad_overflow", True)
    bf16.no_effect("immediate_grad_update", "no effect")
    bf16.refuse(
        "bf16_master_weights_and_grads", bool, "it asks for bf16 master weights", "remove it"
    )
    bf16.refuse("bf16_optimizer_states", bool, "it asks for bf16 optimizer states", "remove it")
    bf16.finish(unknown="error")

    fp16 = top.section("fp16")
    fp16_on = fp16.bool("enabled", False)
    auto_cast = fp16.bool("auto_cast", False)
    if auto_cast and not fp16_on:
        top.ignored.append(("fp16.auto_cast", "fp16 is off"))
    fp16.refuse(
        "fp16_master_weights_and_grads", bool, "it asks for fp16 master weights", "remove it"
    )
    static = fp16.number("loss_scale", 0.0, minimum=0.0)
    power = fp16.int("initial_scale_power", 16, minimum=0)
    window = fp16.int("loss_scale_window", 1000)
    hysteresis = fp16.int("hysteresis", 2)
    consecutive = fp16.bool("consecutive_hysteresis", False)
    min_scale = fp16.number("min_loss_scale", 1.0)
    fp16.finish(unknown="error")
    if fp16_on and bf16_on:
        raise ValueError(
            f"config keys 'fp16.enabled' and '{bf16_name}.enabled' are both true: training "
            "runs in one of them; disable one"
        )
    if fp16_on:
        if min_scale <= 0:
            raise fp16.fail("min_loss_scale", min_scale, "it must be > 0", "use 1 or more")
        if static > 0:
            scale = LossScaleConfig(
                init_scale=static,
                dynamic=False,
                min_scale=min(static, 1.0),
                max_scale=max(static, 2.0**24),
            )
        else:
            init = 2.0**power
            if min_scale > init:
                raise fp16.fail(
                    "min_loss_scale",
                    min_scale,
                    f"it is above the initial scale 2**initial_scale_power = {init:g}",
                    "lower min_loss_scale or raise initial_scale_power",
                )
            if hysteresis > 1 and not consecutive:
                top.ignored.append(
                    (
                        "fp16.consecutive_hysteresis",
                        "false acts as true: hysteresis refills after every clean step",
                    )
                )
            scale = LossScaleConfig(
                init_scale=init,
                growth_interval=window,
                hysteresis=hysteresis,
                min_scale=min_scale,
                max_scale=max(init, 2.0**64),
            )
        return PrecisionSection("fp16", scale, auto_cast=auto_cast)
    if bf16_on:
        scale = LossScaleConfig(init_scale=1.0, dynamic=False) if check else None
        return PrecisionSection("bf16", scale)
    return PrecisionSection("fp32", None)


_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad")
_SGD_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")


def _parse_optimizer(top: _Section) -> OptimizerSection | None:
    if top.raw("optimizer", None) is None:
        return None
    opt = top.section("optimizer")
    kind = opt.raw("type", None)
    if not isinstance(kind, str):
        raise TypeError(
            f"config key 'optimizer.type' must be a string such as 'AdamW', got {_fmt(kind)}"
        )
    opt.no_effect("legacy_fusion", "no effect")
    params_section = opt.section("params")
    opt.finish(unknown="error")
    lower = kind.lower()
    if lower not in ("adam", "adamw", "sgd"):
        raise opt.unsupported(
            "type",
            kind,
            "flatzero's config optimizers are Adam, AdamW and SGD",
            "use one of them, or build the optimizer yourself and pass it as "
            "flatzero.initialize(optimizer=torch.optim.X(...)) with an elementwise torch.optim "
            "class (Adagrad, RMSprop, ...)",
            f"the {kind} optimizer",
        )
    p = params_section
    if "max_grad_norm" in p:
        raise p.fail(
            "max_grad_norm",
            p.data["max_grad_norm"],
            "gradient clipping is not an optimizer parameter",
            "use the top-level key 'gradient_clipping'",
        )
    params: dict[str, Any] = {}
    if lower in ("adam", "adamw"):
        adam_w_mode = p.bool("adam_w_mode", True)
        torch_adam = p.bool("torch_adam", False)
        torch_name = "AdamW" if lower == "adamw" or adam_w_mode else "Adam"
        p.no_effect("fp32_optimizer_states", "optimizer states are always fp32")
        p.no_effect("foreach", "the optimizer runs on one flat tensor per group")
        if not p.bool("bias_correction", True):
            raise p.unsupported(
                "bias_correction",
                False,
                "Adam without bias correction is not available in torch.optim",
                "remove it",
                "Adam without bias correction",
            )
        for name in _ADAM_KEYS:
            if name == "betas":
                value = p.raw(name, None)
                if value is None:
                    continue
                if (
                    not isinstance(value, (list, tuple))
                    or len(value) != 2
                    or not all(
                        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
                    )
                ):
                    raise p.fail(
                        name, value, "it must be a list of two numbers", "e.g. [0.9, 0.999]"
                    )
                params[name] = (float(value[0]), float(value[1]))
            elif name == "amsgrad":
                if name in p:
                    params[name] = p.bool(name, False)
            elif name in p:
                params[name] = p.number(name, None, minimum=0.0)
        if "weight_decay" not in params and not torch_adam:
            # DeepSpeed's FusedAdam defaults to no weight decay (torch's AdamW to 0.01).
            params["weight_decay"] = 0.0
    else:
        torch_name = "SGD"
        p.no_effect("foreach", "the optimizer runs on one flat tensor per group")
        for name in _SGD_KEYS:
            if name in ("nesterov", "maximize"):
                if name in p:
                    params[name] = p.bool(name, False)
            elif name in p:
                params[name] = p.number(name, None, minimum=0.0)
    p.finish(unknown="error")
    return OptimizerSection(kind, torch_name, params)


def _parse_scheduler(top: _Section) -> SchedulerSection | None:
    if top.raw("scheduler", None) is None:
        return None
    sched = top.section("scheduler")
    kind = sched.raw("type", None)
    if not isinstance(kind, str):
        raise TypeError(
            f"config key 'scheduler.type' must be a string such as 'WarmupLR', got {_fmt(kind)}"
        )
    params_section = sched.section("params")
    sched.finish(unknown="error")
    if kind in SCHEDULERS:
        cls: Any = SCHEDULERS[kind]
    elif kind in ("OneCycle", "LRRangeTest"):
        raise sched.unsupported(
            "type",
            kind,
            f"DeepSpeed's {kind} schedule is not implemented in flatzero (its schedules are "
            f"{', '.join(SCHEDULERS)}, plus any torch.optim.lr_scheduler class)",
            "use one of those, or pass lr_scheduler= to flatzero.initialize",
            f"the {kind} schedule",
        )
    else:
        cls = getattr(torch.optim.lr_scheduler, kind, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.lr_scheduler.LRScheduler)):
            raise sched.fail(
                "type",
                kind,
                f"it is neither a DeepSpeed schedule flatzero implements ({', '.join(SCHEDULERS)}) "
                "nor a torch.optim.lr_scheduler class",
                "fix its spelling",
            )
    params: dict[str, Any] = {}
    for name in params_section.data:
        value = params_section.raw(name)
        params[name] = value
    signature = inspect.signature(cls)
    accepted = [n for n in signature.parameters if n not in ("self", "optimizer")]
    for name in params:
        if name not in signature.parameters or name == "optimizer":
            raise params_section.fail(
                name,
                params[name],
                f"{kind} has no such parameter (it takes {', '.join(accepted)})",
                "fix its spelling or remove it",
            )
    try:
        signature.bind(None, **params)
    except TypeError as error:
        raise ValueError(
            f"config key 'scheduler.params' does not fit {kind}: {error}; it takes "
            f"{', '.join(accepted)}"
        ) from None
    return SchedulerSection(kind, params)


def _parse_flatzero(top: _Section) -> FlatzeroSection:
    fz = top.section("flatzero")
    tier = fz.choice("tier", "auto", TIERS)
    bucket = fz.int("bucket_numel", None, unit=" (elements)")
    device = fz.raw("device", None)
    if device is not None and not isinstance(device, str):
        raise TypeError(f"config key 'flatzero.device' must be a string, got {_fmt(device)}")
    threads = fz.int("host_threads", None)
    staging = fz.int("staging_buffers", 2)
    reduce_staging = fz.int("reduce_staging_buffers", 2)
    learn = fz.bool("learn_bucket_order", True)
    sync = fz.choice("param_sync", "gather", PARAM_SYNC)
    progress = fz.bool("progress", True)
    elementwise = fz.bool("elementwise_optimizer", False)
    fz.finish(unknown="error")
    return FlatzeroSection(
        tier, bucket, device, threads, staging, reduce_staging, learn, sync, progress, elementwise
    )


_TOP_NO_EFFECT = {
    "wall_clock_breakdown": "no timers",
    "memory_breakdown": "no memory logging",
    "dump_state": "no effect",
    "zero_allow_untested_optimizer": "any elementwise torch.optim optimizer is allowed",
    "zero_force_ds_cpu_optimizer": "no DeepSpeed CPU optimizer",
    "tensorboard": "no monitors",
    "wandb": "no monitors",
    "csv_monitor": "no monitors",
    "comet": "no monitors",
    "aim": "no monitors",
    "comms_logger": "no comms logging",
    "flops_profiler": "no profiler",
    "timers": "no timers",
    "checkpoint": "flatzero's checkpoint format is fixed",
    "activation_checkpointing": "applies to deepspeed.checkpointing only",
    "aio": "no NVMe offload",
    "prescale_gradients": "gradients are summed in fp32 and divided once",
    "gradient_predivide_factor": "gradients are summed in fp32 and divided once",
    "sparse_gradients": "no effect",
    "disable_allgather": "no effect",
    "seq_parallel_communication_data_type": "no sequence parallelism",
    "data_types": "gradients accumulate in the fp32 shard (stage 2) or the param dtype",
    "use_data_before_expert_parallelism": "no expert parallelism",
    "use_node_local_storage": "no effect",
    "disable_python_gc": "no effect",
    "graph_harvesting": "no effect",
    "zero_optimization_stage": "no effect",
    "train_micro_batch_size_per_device": "no effect",
    "log_level": "no effect",
    "pipeline": "no pipeline parallelism",
}
_TOP_UNSUPPORTED = {
    "amp": "it asks for apex AMP",
    "torch_autocast": "it asks for torch autocast",
    "elasticity": "it asks for elastic training",
    "autotuning": "it asks for autotuning",
    "hybrid_engine": "it asks for the hybrid engine",
    "data_efficiency": "it asks for data efficiency",
    "curriculum_learning": "it asks for curriculum learning",
    "eigenvalue": "it asks for eigenvalue computation",
    "progressive_layer_drop": "it asks for progressive layer drop",
    "nebula": "it asks for Nebula checkpointing",
    "quantize_training": "it asks for quantized training",
    "compile": "it asks for DeepCompile",
}


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
    top = _Section(data, "", ignored)

    batch = _parse_batch(top, world_size)
    zero = _parse_zero(top)
    precision = _parse_precision(top)
    optimizer = _parse_optimizer(top)
    scheduler = _parse_scheduler(top)
    clip = top.number("gradient_clipping", 0.0, minimum=0.0)
    spp = top.raw("steps_per_print", 10)
    if isinstance(spp, float) and spp == math.inf:
        spp = None  # Accelerate's "never": it always sets inf
    elif spp is not None:
        spp = top.int("steps_per_print", 10)
    comm = top.raw("communication_data_type", None)
    if comm is not None:
        comm = top.choice("communication_data_type", None, tuple(_COMM_DTYPES))
    drop_last = top.bool("dataloader_drop_last", False)
    flatzero = _parse_flatzero(top)

    for name, what in _TOP_UNSUPPORTED.items():
        if name == "compile":
            top.refuse(name, _compile_on, what, "remove it (or set deepcompile: false)")
        else:
            top.refuse(name, _enabled, what, "remove it (or set enabled: false)")
    top.refuse(
        "sequence_parallel_size",
        lambda v: v not in (None, 1),
        "it asks for sequence parallelism",
        "remove it",
    )
    top.refuse(
        "tensor_parallel",
        lambda v: isinstance(v, Mapping) and v.get("autotp_size", 0) not in (0, 1),
        "it asks for tensor parallelism",
        "remove it",
    )
    top.refuse(
        "gradient_allreduce_op",
        lambda v: v != "mean",
        "it asks to sum gradients over ranks instead of averaging them",
        "remove it",
    )
    top.refuse(
        "managed_gradient_accumulation",
        lambda v: v is not True,
        "it asks the caller to own the accumulation boundary",
        "remove it; engine.step() steps at every gradient_accumulation_steps-th call",
    )
    top.refuse("compression_training", bool, "it asks for compression training", "remove it")
    top.refuse("sparse_attention", bool, "it asks for sparse attention", "remove it")
    top.refuse("weight_quantization", bool, "it asks for weight quantization", "remove it")
    for name, reason in _TOP_NO_EFFECT.items():
        top.no_effect(name, reason)
    top.finish(unknown="ignore")

    return EngineConfig(
        batch=batch,
        zero=zero,
        precision=precision,
        optimizer=optimizer,
        scheduler=scheduler,
        gradient_clipping=clip if clip else None,
        steps_per_print=spp,
        reduce_dtype=_COMM_DTYPES[comm] if comm is not None else torch.float32,
        dataloader_drop_last=drop_last,
        flatzero=flatzero,
        ignored=tuple(ignored),
        source=data,
    )
