"""The DeepSpeed config of ``flatzero.initialize``, parsed once into frozen dataclasses.

``parse_config(config, world_size=...)`` reads a DeepSpeed config (a dict, or the path of a
JSON file) and returns an ``EngineConfig`` holding the PyTorch door's own objects
(``FlattenConfig``, ``ZeroConfig`` with its ``LossScaleConfig``), the optimizer and
scheduler specs, the batch sizes and the engine's own settings; nothing else in flatzero
reads the dict. By job:

- ``reader``: the dict, and typed reads of its sections with the key path in errors;
- ``keys``: the keys accepted without effect and the keys refused, as tables;
- ``schema``: the dataclasses a config parses into;
- ``flatzero_section``: the ``flatzero`` section, derived from the fields of
  ``FlattenConfig``, ``ZeroConfig`` and ``FlatzeroSection``;
- ``sections``: the batch sizes, ``zero_optimization``, ``bf16``/``fp16``;
- ``optimizer``: the ``optimizer`` and ``scheduler`` sections;
- ``parse``: ``parse_config``, which puts them together.

The kinds of keys: see the note in ``keys``; the batch-size rule: the note in ``sections``.
"""

from .flatzero_section import FLATZERO_KEYS, FlatzeroKey
from .parse import parse_config
from .reader import load_config_dict
from .schema import (
    PARAM_SYNC,
    BatchConfig,
    EngineConfig,
    FlatzeroSection,
    OptimizerSpec,
    PrecisionSection,
    SchedulerSpec,
    ZeroSection,
)

__all__ = [
    "FLATZERO_KEYS",
    "PARAM_SYNC",
    "BatchConfig",
    "EngineConfig",
    "FlatzeroKey",
    "FlatzeroSection",
    "OptimizerSpec",
    "PrecisionSection",
    "SchedulerSpec",
    "ZeroSection",
    "load_config_dict",
    "parse_config",
]
