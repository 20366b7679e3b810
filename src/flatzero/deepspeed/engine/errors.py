"""The error that tells "DeepSpeed can do this, flatzero cannot" apart from a user error.

``flatzero.initialize`` raises ``UnsupportedFeatureError`` when the config or the arguments
ask for a DeepSpeed feature flatzero does not implement (ZeRO stage 3, NVMe or param
offload, model parallelism, no optimizer, an optimizer that is not elementwise, ...). It
raises plain ``ValueError``/``TypeError`` for a config or argument that is wrong whoever
runs it (bad types, inconsistent batch sizes, misspelled keys).
``flatzero.patch_deepspeed()`` hands the first kind to the real ``deepspeed.initialize`` and
lets the second fail loudly.

Both kinds are raised before anything is flattened: the model is untouched.
"""

from __future__ import annotations

__all__ = ["UnsupportedFeatureError"]


class UnsupportedFeatureError(ValueError):
    """A DeepSpeed feature flatzero does not implement (a ``ValueError``).

    Attributes:
        key: the config key or argument that asks for it (``"zero_optimization.stage"``,
            ``"mpu"``, ``"optimizer"``, ...).
        feature: a few words naming the feature (``"ZeRO stage 3"``).
    """

    def __init__(self, message: str, *, key: str, feature: str) -> None:
        super().__init__(message)
        self.key = key
        self.feature = feature
