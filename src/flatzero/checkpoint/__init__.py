"""Checkpoints that load at any world size and export to safetensors.

- ``save_checkpoint`` / ``load_checkpoint``: one safetensors file per rank with its fp32
  master and optimizer-state shards, the layout and scalar state in ``meta.json``, written
  atomically; loaded at any world size or bucket size by reading only the needed slices.
- ``export_checkpoint``: consolidated weights keyed by param name (HF-style shards).

See docs/checkpoints.md.
"""

from .config import ExportConfig, LoadConfig, SaveConfig
from .export import ExportResult, export_checkpoint
from .format import CheckpointDamaged, CheckpointMeta, available_tags, read_latest
from .load import LoadResult, load_checkpoint, load_flat_params
from .preemption import Preempted, PreemptionConfig, SignalWatch, save_on_signal
from .reader import CheckpointReader
from .save import save_checkpoint

__all__ = [
    "CheckpointDamaged",
    "CheckpointMeta",
    "CheckpointReader",
    "ExportConfig",
    "ExportResult",
    "LoadConfig",
    "LoadResult",
    "Preempted",
    "PreemptionConfig",
    "SaveConfig",
    "SignalWatch",
    "available_tags",
    "export_checkpoint",
    "load_checkpoint",
    "load_flat_params",
    "read_latest",
    "save_checkpoint",
    "save_on_signal",
]
