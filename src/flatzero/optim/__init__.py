"""ZeRO stage 1 and 2 optimizer over flatzero's flat, sharded buffers (the PyTorch door)."""

from .config import LossScaleConfig, OffloadConfig, ZeroConfig
from .grad_check import GradientMismatch
from .inner import ELEMENTWISE_OPTIMIZERS
from .state import STATE_DICT_FORMAT, GroupState, ShardedOptimizerState
from .zero import ZeroOptimizer

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "STATE_DICT_FORMAT",
    "GradientMismatch",
    "GroupState",
    "LossScaleConfig",
    "OffloadConfig",
    "ShardedOptimizerState",
    "ZeroConfig",
    "ZeroOptimizer",
]
