"""Moved to ``flatzero.measure.baselines`` (``flatzero plan`` predicts DeepSpeed's paths
with it too, and the product imports nothing from ``bench``); the names stay importable
from here."""

from __future__ import annotations

from ..deepspeed.layout import ALIGNMENT_FACTOR as NCCL_START_ALIGNMENT_FACTOR
from ..deepspeed.layout import padded_numel as deepspeed_padded_numel
from ..deepspeed.layout import partition_range as deepspeed_partition_range
from ..measure.baselines import (
    BaselineResult,
    available_bytes,
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
