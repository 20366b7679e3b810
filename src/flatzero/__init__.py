"""flatzero: ZeRO stage 1 and 2 for PyTorch, with initialization as fast as the hardware allows."""

from .config import TIERS, FlattenConfig
from .flatten import FlatGroup, FlatParams, flatten_parameters, inject_oom
from .layout import Layout, ParamSpec, plan_layout
from .report import InitReport

__all__ = [
    "TIERS",
    "FlatGroup",
    "FlatParams",
    "FlattenConfig",
    "InitReport",
    "Layout",
    "ParamSpec",
    "flatten_parameters",
    "inject_oom",
    "plan_layout",
]

__version__ = "0.1.0"
