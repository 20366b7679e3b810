"""flatzero: ZeRO stage 1 and 2 for PyTorch, with initialization as fast as the hardware allows."""

from .config import TIERS, FlattenConfig
from .engine import initialize
from .flatten import FlatGroup, FlatParams, flatten_parameters, inject_oom
from .layout import Layout, ParamSpec, plan_layout
from .loading import load_flat
from .report import InitReport
from .safetensors_index import SafetensorsCheckpoint

__all__ = [
    "TIERS",
    "FlatGroup",
    "FlatParams",
    "FlattenConfig",
    "InitReport",
    "Layout",
    "ParamSpec",
    "SafetensorsCheckpoint",
    "flatten_parameters",
    "initialize",
    "inject_oom",
    "load_flat",
    "plan_layout",
]

__version__ = "0.1.0"
