"""DeepSpeed's engine getters (``train_batch_size()``, ``zero_optimization_stage()``, ...),
answered from the parsed config, the optimizer and the process group."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ...comm import rank_of, world_size_of

if TYPE_CHECKING:
    from ...optim import OffloadConfig, ZeroOptimizer
    from .config import EngineConfig

__all__ = ["DeepSpeedGetters"]


class DeepSpeedGetters:
    """The getters of ``deepspeed.DeepSpeedEngine`` that scripts, Accelerate and the HF
    Trainer call, as a base class of ``Engine``."""

    parsed_config: EngineConfig
    optimizer: ZeroOptimizer
    _pg: dist.ProcessGroup | None

    @property
    def world_size(self) -> int:
        """Data-parallel ranks."""
        return world_size_of(self._pg)

    @property
    def global_rank(self) -> int:
        """This rank."""
        return rank_of(self._pg)

    @property
    def device(self) -> torch.device:
        """Where the flat buffers (and the module) live."""
        return self.optimizer.flat.groups[0].device

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self.parsed_config.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-batch on one rank."""
        return self.parsed_config.batch.micro_batch_per_gpu

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.parsed_config.batch.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        """ZeRO stage (0, 1 or 2)."""
        return self.parsed_config.zero.stage

    def gradient_clipping(self) -> float:
        """Max gradient norm (0.0: no clipping), as DeepSpeed reports it."""
        return self.parsed_config.gradient_clipping or 0.0

    def fp16_enabled(self) -> bool:
        """Whether training runs in fp16."""
        return self.parsed_config.precision.dtype == "fp16"

    def bfloat16_enabled(self) -> bool:
        """Whether training runs in bf16."""
        return self.parsed_config.precision.dtype == "bf16"

    def fp16_auto_cast(self) -> bool:
        """``fp16.auto_cast``: forward casts floating-point positional inputs to fp16."""
        return self.parsed_config.precision.auto_cast

    def dynamic_loss_scale(self) -> bool:
        """Whether the fp16 loss scale is dynamic."""
        scale = self.parsed_config.precision.loss_scale
        return self.fp16_enabled() and scale is not None and scale.dynamic

    def steps_per_print(self) -> int | None:
        """Optimizer steps between progress lines (None: never)."""
        return self.parsed_config.steps_per_print

    def zero_optimization(self) -> bool:
        """Whether a ZeRO stage above 0 is on."""
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_gradients(self) -> bool:
        """Whether gradients are partitioned (stage 2)."""
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        """Always False: params are never partitioned (no stage 3)."""
        return False

    def zero_offload_optimizer(self) -> OffloadConfig | None:
        """The optimizer offload settings (``zero_optimization.offload_optimizer`` with
        device ``cpu``), or None; DeepSpeed returns its offload config object or None."""
        return self.parsed_config.zero_optimizer.offload_optimizer

    def zero_offload_param(self) -> bool:
        """Always False: params are never offloaded (ZeRO-3's ``offload_param``)."""
        return False

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer is offloaded to host memory (``offload_optimizer.device``
        ``cpu``, or the older ``cpu_offload: true``)."""
        return self.parsed_config.zero_optimizer.offload_optimizer is not None

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Always False: stage 3 only (the module holds whole weights)."""
        return False

    def zero_reduce_bucket_size(self) -> int:
        """Bucket size in elements."""
        return self.parsed_config.bucket_numel

    def zero_allgather_bucket_size(self) -> int:
        """Bucket size in elements (one size for both collectives)."""
        return self.parsed_config.bucket_numel

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are summed over ranks in."""
        return self.parsed_config.reduce_dtype

    def get_data_parallel_rank(self) -> int:
        """This rank in the data-parallel group."""
        return self.global_rank

    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        return (
            self.train_batch_size(),
            self.train_micro_batch_size_per_gpu(),
            self.gradient_accumulation_steps(),
        )

    def dataloader_drop_last(self) -> bool:
        """``drop_last`` of the loader built from ``training_data``."""
        return self.parsed_config.dataloader_drop_last

    def get_lr(self) -> list[float]:
        """The lr of every param group of the optimizer."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without fp16)."""
        return self.optimizer.loss_scale
