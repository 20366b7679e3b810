"""flatzero: ZeRO stage 1 and 2 for PyTorch, with initialization as fast as the hardware allows."""

from ._version import __version__ as __version__
from .checkpoint import export_checkpoint, load_checkpoint, save_checkpoint
from .config import FlattenConfig
from .deepspeed.engine import UnsupportedFeatureError, initialize
from .deepspeed.patch import DeepSpeedPatch, patch_deepspeed
from .flatten import FlatGroup, FlatParams, flatten_parameters, inject_oom
from .flatten.registry import TIERS
from .layout import Layout, ParamSpec, plan_layout
from .loading import load_flat
from .optim import LossScaleConfig, OffloadConfig, ZeroConfig, ZeroOptimizer
from .report import InitReport
from .storage.index import SafetensorsCheckpoint

__all__ = [
    "TIERS",
    "DeepSpeedPatch",
    "FlatGroup",
    "FlatParams",
    "FlattenConfig",
    "InitReport",
    "Layout",
    "LossScaleConfig",
    "OffloadConfig",
    "ParamSpec",
    "SafetensorsCheckpoint",
    "UnsupportedFeatureError",
    "ZeroConfig",
    "ZeroOptimizer",
    "export_checkpoint",
    "flatten_parameters",
    "initialize",
    "inject_oom",
    "load_checkpoint",
    "load_flat",
    "patch_deepspeed",
    "plan_layout",
    "save_checkpoint",
]
