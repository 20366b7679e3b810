"""ZeRO stage 1 and 2 optimizer over flatzero's flat, sharded buffers (the PyTorch door)."""

from .config import LossScaleConfig, ZeroConfig
from .inner import ELEMENTWISE_OPTIMIZERS
from .zero import STATE_DICT_FORMAT, ZeroOptimizer

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "STATE_DICT_FORMAT",
    "LossScaleConfig",
    "ZeroConfig",
    "ZeroOptimizer",
]
