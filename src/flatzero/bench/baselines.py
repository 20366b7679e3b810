"""Moved to ``flatzero.measure.baselines`` (``flatzero plan`` predicts DeepSpeed's paths
with it too, and the product imports nothing from ``bench``); the names stay importable
from here."""

from __future__ import annotations

from ..measure.baselines import (
    NCCL_START_ALIGNMENT_FACTOR,
    BaselineResult,
    available_bytes,
    deepspeed_padded_numel,
    deepspeed_partition_range,
    flatten_legacy_cpu,
    flatten_torch_cat,
    trainable_params,
)

__all__ = [
    "NCCL_START_ALIGNMENT_FACTOR",
    "BaselineResult",
    "available_bytes",
    "deepspeed_padded_numel",
    "deepspeed_partition_range",
    "flatten_legacy_cpu",
    "flatten_torch_cat",
    "trainable_params",
]
