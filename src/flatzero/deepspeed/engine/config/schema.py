"""What a DeepSpeed config parses into: the PyTorch door's own config objects
(``FlattenConfig``, ``ZeroConfig`` with its ``LossScaleConfig``) plus what only the
DeepSpeed door has (batch sizes, the ZeRO stage, the optimizer and scheduler named in the
config, the engine's own settings).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from ....checkpoint.config import LOAD_FALLBACKS
from ....config import FlattenConfig
from ....dtypes import SHORT_DTYPES
from ....optim import LossScaleConfig, ZeroConfig
from ....optim.deepspeed_muon import DeepSpeedMuon
from ..schedulers import SCHEDULERS

__all__ = [
    "OPTIMIZERS",
    "PARAM_SYNC",
    "BatchConfig",
    "EngineConfig",
    "FlatzeroSection",
    "OptimizerSpec",
    "PrecisionSection",
    "SchedulerSpec",
    "ZeroSection",
]

PARAM_SYNC = ("gather", "check", "none")
"""``flatzero.param_sync`` choices: how ranks agree on the initial weights."""

OPTIMIZERS = ("AdamW", "Adam", "SGD", "Muon")
"""The classes a config ``optimizer`` section can name: ``torch.optim``'s, and ``Muon``,
DeepSpeed's Muon (``optim.deepspeed_muon.DeepSpeedMuon``)."""


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
    """``zero_optimization``: what the DeepSpeed door does beyond ``ZeroConfig``.

    Attributes:
        stage: 0 (plain data parallel: all-reduced gradients, replicated optimizer state;
            the optimizer runs as stage 1 over a one-rank group per rank), 1 (sharded
            optimizer state) or 2 (sharded gradients too).
        overlap_comm: ``zero_optimization.overlap_comm``, or None when absent (or with
            optimizer offload): ``ZeroConfig.overlap_param_gather``.
        check_unused: ``ignore_unused_parameters: false`` with optimizer offload: the step
            asserts that every trainable param got a gradient in the accumulation window,
            as DeepSpeed's offloaded ZeRO-1/2 does (``engine/unused_check.py``).
    """

    stage: int = 0
    overlap_comm: bool | None = None
    check_unused: bool = False

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
            DeepSpeed does), or None. ``ZeroConfig.loss_scale`` is this object.
        auto_cast: ``fp16.auto_cast``: the engine's forward casts floating-point
            positional inputs to fp16, as DeepSpeed's does (fp16 only).
    """

    dtype: str = "fp32"
    loss_scale: LossScaleConfig | None = None
    auto_cast: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in SHORT_DTYPES:
            raise ValueError(f"PrecisionSection.dtype must be fp32, bf16 or fp16: {self.dtype!r}")
        if self.auto_cast and self.dtype != "fp16":
            raise ValueError(f"PrecisionSection.auto_cast needs dtype fp16, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The params' dtype, or None for fp32 (each param keeps its dtype)."""
        return None if self.dtype == "fp32" else SHORT_DTYPES[self.dtype]


@dataclass(frozen=True)
class OptimizerSpec:
    """``optimizer``: which ``torch.optim`` class runs on the flat shards, and its args.

    Attributes:
        type: the config's ``type`` as written (``"AdamW"``, ``"adam"``, ``"SGD"``).
        torch_name: the class (one of ``OPTIMIZERS``): ``"AdamW"`` (DeepSpeed's ``Adam``
            with its default ``adam_w_mode: true``, and ``AdamW``), ``"Adam"``, ``"SGD"``,
            or ``"Muon"`` (DeepSpeed's, its params the config's: ``engine.muon_groups``).
        params: keyword arguments of that class (lr, betas, eps, weight_decay, ...), with
            DeepSpeed's defaults for keys it sets differently from torch.
    """

    type: str
    torch_name: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.torch_name not in OPTIMIZERS:
            raise ValueError(f"OptimizerSpec.torch_name {self.torch_name!r} is not supported")
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    @property
    def torch_class(self) -> type[torch.optim.Optimizer]:
        """The optimizer class: ``torch.optim``'s, or ``DeepSpeedMuon`` for ``Muon``."""
        if self.torch_name == "Muon":
            return DeepSpeedMuon
        return getattr(torch.optim, self.torch_name)

    def kwargs(self) -> dict[str, Any]:
        """A fresh dict of the keyword arguments."""
        return dict(self.params)


@dataclass(frozen=True)
class SchedulerSpec:
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
    """The keys of the ``flatzero`` section that only ``initialize`` reads (the section's
    other keys are fields of ``FlattenConfig`` and ``ZeroConfig``; see ``FLATZERO_KEYS``).

    Attributes:
        param_sync: how ranks agree on the initial weights after flattening: ``gather``
            (each rank's slice of every bucket is all-gathered, so all ranks hold the same
            weights, as DeepSpeed's broadcast from rank 0 ensures; stage 0 broadcasts from
            rank 0), ``check`` (compare a checksum, raise if ranks differ) or ``none``.
            Skipped when the flatten tier already all-gathered (``sharded``).
        elementwise_optimizer: vouch that a client optimizer class flatzero does not know
            is elementwise (``ZeroOptimizer(elementwise_optimizer=True)``).
        load_fallback: what ``engine.load_checkpoint`` does with a missing, incomplete or
            corrupt checkpoint: ``none`` raises on every rank naming the newest tag that is
            complete and verifies, ``newest_valid`` loads that tag with a warning
            (``LoadConfig.fallback``).
        async_save: ``engine.save_checkpoint`` copies the rank's shards into reusable host
            memory and returns; a background thread writes and publishes the checkpoint
            (``save_checkpoint(asynchronous=True)``); the next save or load, and
            ``engine.destroy()``, wait for it and raise its error on every rank.
        preemption_dir: save on a signal: on ``preemption_signals`` every rank saves the
            same step into this directory at the next boundary ``engine.step()``, then
            ``flatzero.checkpoint.Preempted`` (a ``SystemExit``) ends the process
            (``flatzero.checkpoint.preemption``); null: off.
        preemption_signals: the signals that ask for the save, comma-separated names.
        preemption_grace_s: seconds between the signal and the kill (the least of the
            scheduler's grace and torchrun's 30 s); a save starting later is logged as
            likely to be killed (seconds).
        preemption_check_every: optimizer steps between the ranks' agreements on a signal
            (one host-side all-reduce of one scalar each).
        preemption_exit_code: the exit status after the save, 1 to 255 (null: 128 + the signal's
            number).
    """

    param_sync: str = field(default="gather", metadata={"choices": PARAM_SYNC})
    elementwise_optimizer: bool = False
    load_fallback: str = field(default="none", metadata={"choices": LOAD_FALLBACKS})
    async_save: bool = False
    preemption_dir: str | None = None
    preemption_signals: str = "SIGTERM,SIGUSR1"
    preemption_grace_s: int = 30
    preemption_check_every: int = 1
    preemption_exit_code: int | None = None

    def __post_init__(self) -> None:
        if self.param_sync not in PARAM_SYNC:
            raise ValueError(
                f"FlatzeroSection.param_sync must be one of {PARAM_SYNC}, got {self.param_sync!r}"
            )
        if self.load_fallback not in LOAD_FALLBACKS:
            raise ValueError(
                f"FlatzeroSection.load_fallback must be one of {LOAD_FALLBACKS}, got "
                f"{self.load_fallback!r}"
            )


@dataclass(frozen=True)
class EngineConfig:
    """A parsed DeepSpeed config: everything ``flatzero.initialize`` and the engine use.

    Attributes:
        batch: batch sizes (resolved).
        zero: the ZeRO stage (``zero_optimization.stage``).
        precision: training dtype and loss scaling.
        flatten: how ``initialize`` flattens the params (the PyTorch door's
            ``FlattenConfig``: the ``flatzero`` section's keys, the bucket size, the dtype).
        zero_optimizer: how the ``ZeroOptimizer`` reduces and steps (``ZeroConfig``:
            clipping, ``communication_data_type``, the loss scale, ``flatzero`` keys).
        optimizer: the ``optimizer`` section, or None (a client optimizer must be passed).
        scheduler: the ``scheduler`` section, or None.
        flatzero: the ``flatzero`` keys only ``initialize`` reads.
        buffer_dtype: ``data_types.buffer_dtype``: floating-point buffers are cast to it;
            None (DeepSpeed's default): every buffer keeps its dtype.
        steps_per_print: log progress every this many optimizer steps (None: never, as
            DeepSpeed 0.19 when the key is absent; also the config's ``null`` or ``inf``).
        dataloader_drop_last: ``drop_last`` of the data loader built from ``training_data``.
        ignored: ``(key, reason)`` of every key accepted without effect, in config order.
        source: the config as given (read-only).
    """

    batch: BatchConfig
    zero: ZeroSection
    precision: PrecisionSection
    flatten: FlattenConfig
    zero_optimizer: ZeroConfig
    optimizer: OptimizerSpec | None = None
    scheduler: SchedulerSpec | None = None
    flatzero: FlatzeroSection = FlatzeroSection()
    buffer_dtype: torch.dtype | None = None
    steps_per_print: int | None = None
    dataloader_drop_last: bool = False
    ignored: tuple[tuple[str, str], ...] = ()
    source: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.steps_per_print is not None and self.steps_per_print < 1:
            raise ValueError(
                f"EngineConfig.steps_per_print must be >= 1 or None, got {self.steps_per_print}"
            )
        if self.zero_optimizer.stage != max(1, self.zero.stage):
            raise ValueError(
                f"EngineConfig.zero_optimizer.stage is {self.zero_optimizer.stage} but the ZeRO "
                f"stage is {self.zero.stage} (stage 0 runs as a stage 1 optimizer)"
            )
        object.__setattr__(self, "source", MappingProxyType(dict(self.source)))

    @property
    def replicated(self) -> bool:
        """Stage 0 at several ranks: every rank runs a one-rank optimizer over the whole
        model (sharded over a one-rank group) and the engine all-reduces the gradients."""
        return self.zero.stage == 0 and self.batch.world_size > 1

    @property
    def gradient_clipping(self) -> float | None:
        """Max global L2 norm of the gradient, or None (0 in the config)."""
        return self.zero_optimizer.max_grad_norm

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype gradients are summed over ranks in (``communication_data_type``)."""
        return self.zero_optimizer.reduce_dtype

    @property
    def bucket_numel(self) -> int:
        """Bucket size in elements: ``flatzero.bucket_numel``, else ``reduce_bucket_size``,
        else ``allgather_bucket_size``, else ``FlattenConfig``'s default (64 Mi elements)."""
        return self.flatten.bucket_numel

    def flatten_config(self) -> FlattenConfig:
        """The ``FlattenConfig`` of the model's flat buffers."""
        return self.flatten

    def zero_config(self) -> ZeroConfig:
        """The ``ZeroConfig`` of the optimizer (stage 0 runs as a stage 1 optimizer over
        a one-rank group, with gradients all-reduced by the engine)."""
        return self.zero_optimizer

    def ignored_summary(self) -> str:
        """One line listing the keys without effect (empty when there are none)."""
        return "; ".join(f"{key} ({reason})" for key, reason in self.ignored)
