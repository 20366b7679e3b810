"""flatzero: ZeRO stage 1 and 2 for PyTorch, with initialization as fast as the hardware allows.

[Note: the public names load on first use]
``import flatzero`` imports no torch: the command line (``flatzero --help``, an argument
error) answers at once, and a submodule (``flatzero.cli``, ``flatzero._version``) costs only
itself. The first public name asked for (``flatzero.initialize``, ``from flatzero import
ZeroOptimizer``, ``dir(flatzero)``) imports every module behind ``__all__``, in the order an
eager ``__init__`` had them, so the checks rooms above register with ``config`` are in place.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__

if TYPE_CHECKING:
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

_WHERE: dict[str, str] = {
    "export_checkpoint": ".checkpoint",
    "load_checkpoint": ".checkpoint",
    "save_checkpoint": ".checkpoint",
    "FlattenConfig": ".config",
    "UnsupportedFeatureError": ".deepspeed.engine",
    "initialize": ".deepspeed.engine",
    "DeepSpeedPatch": ".deepspeed.patch",
    "patch_deepspeed": ".deepspeed.patch",
    "FlatGroup": ".flatten",
    "FlatParams": ".flatten",
    "flatten_parameters": ".flatten",
    "inject_oom": ".flatten",
    "TIERS": ".flatten.registry",
    "Layout": ".layout",
    "ParamSpec": ".layout",
    "plan_layout": ".layout",
    "load_flat": ".loading",
    "LossScaleConfig": ".optim",
    "OffloadConfig": ".optim",
    "ZeroConfig": ".optim",
    "ZeroOptimizer": ".optim",
    "InitReport": ".report",
    "SafetensorsCheckpoint": ".storage.index",
}
"""Each public name and the module it lives in (imported all together on first use)."""

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
"""The public names: each is a key of ``_WHERE``."""


def _load_all() -> None:
    """Import every module behind ``__all__`` and bind its names here."""
    for name, module in _WHERE.items():
        globals()[name] = getattr(importlib.import_module(module, __name__), name)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _load_all()
    return globals()[name]


def __dir__() -> list[str]:
    _load_all()
    return sorted(set(globals()) | set(_WHERE))
