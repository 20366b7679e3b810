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

Every key falls in one of three kinds:

- implemented: parsed, validated and used (batch sizes, ``zero_optimization`` stage 0-2
  and bucket sizes, ``bf16``, ``fp16``, ``optimizer``, ``scheduler``,
  ``gradient_clipping``, ``steps_per_print``, ``communication_data_type``, the
  ``flatzero`` section);
- without effect here: accepted and listed in ``EngineConfig.ignored`` (monitors,
  profilers, stage-3 tuning keys under stage 1/2, switches flatzero always has on, ...);
  ``initialize`` logs them once in one warning;
- asking for something DeepSpeed has and flatzero does not implement (stage 3, NVMe or param
  offload, quantized or hierarchical ZeRO, torch autocast, pipeline or tensor parallelism,
  optimizer types other than Adam/AdamW/SGD, ...): an ``UnsupportedFeatureError`` (a
  ``ValueError``) naming the key, its value and the fix; ``flatzero.patch_deepspeed()`` hands
  such configs to the real DeepSpeed.

Everything else that is wrong is a user error (``ValueError``/``TypeError``): an unknown key
inside a section flatzero parses (as DeepSpeed's own validation does), a bad type or value,
inconsistent batch sizes, and any ``"auto"`` value where a value has an effect (``"auto"``
is the Hugging Face Trainer's placeholder; the Trainer replaces it before it calls
``deepspeed.initialize``). ``steps_per_print`` may be ``inf`` (Accelerate's "never").

The batch sizes follow DeepSpeed's rule: ``train_batch_size = train_micro_batch_size_per_gpu
* gradient_accumulation_steps * world_size``; any two determine the third (with DeepSpeed's
integer divisions), one alone sets ``gradient_accumulation_steps = 1``, and the three must
then agree exactly.
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
