"""The DeepSpeed door: ``flatzero.initialize`` and its engine, for ZeRO stages 0, 1 and 2.

See docs/deepspeed-door.md.
"""

from .config import EngineConfig, load_config_dict, parse_config
from .engine import Engine
from .errors import UnsupportedFeatureError
from .initialize import initialize
from .report import EngineInitReport
from .schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineInitReport",
    "UnsupportedFeatureError",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "initialize",
    "load_config_dict",
    "parse_config",
]
