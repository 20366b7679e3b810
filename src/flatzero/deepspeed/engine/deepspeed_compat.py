"""An ``Engine`` that is also a ``deepspeed.DeepSpeedEngine`` for ``isinstance``.

Hugging Face Accelerate unwraps a prepared model only when it is an instance of
``deepspeed.DeepSpeedEngine`` (``extract_model_from_parallel``); otherwise the saved
``model.safetensors`` gets ``module.``-prefixed keys that ``from_pretrained`` cannot load.
Other libraries test the same. ``deepspeed_engine_class()`` returns a subclass of both
``Engine`` and ``DeepSpeedEngine``, built once per process when ``deepspeed`` is already
imported (flatzero never imports it: that takes seconds and detects accelerators).

Nothing of DeepSpeed's engine runs: ``Engine.__init__`` calls ``nn.Module.__init__``
directly, never ``DeepSpeedEngine.__init__``; ``Engine`` comes first in the method
resolution order; and every other method, property or attribute of ``DeepSpeedEngine``
(stage 3 gathering, pipeline or DeepCompile hooks, ``offload_states``, ...) is replaced by one
that raises ``NotImplementedError`` naming it. ``DeepSpeedEngine.__del__`` (which would
call ``destroy()`` when the engine is collected) is replaced by nothing.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from .engine import Engine

__all__ = ["deepspeed_engine_class", "not_implemented"]

_CLASSES: dict[type, type] = {}


def not_implemented(name: str) -> Any:
    """A method that raises ``NotImplementedError`` naming ``DeepSpeedEngine.<name>``."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"DeepSpeedEngine.{name} is not implemented by flatzero's engine (ZeRO stage 1/2 "
            "data parallelism, which runs this training because flatzero.patch_deepspeed() is "
            "active); run without the patch (or without python -m flatzero.run) to use "
            "DeepSpeed's engine for it"
        )

    method.__name__ = name
    method.__qualname__ = f"DeepSpeedCompatibleEngine.{name}"
    return method


def _engine_names() -> set[str]:
    """Names ``Engine`` defines itself (not those it inherits from ``nn.Module``)."""
    names: set[str] = set()
    for cls in Engine.__mro__:
        if cls in (nn.Module, object):
            break
        names.update(vars(cls))
    return names


def deepspeed_engine_class() -> type[Engine] | None:
    """The ``Engine`` subclass that derives from ``deepspeed.DeepSpeedEngine`` too, or None
    when ``deepspeed`` is not imported in this process (or has no ``DeepSpeedEngine``)."""
    if "deepspeed" not in sys.modules:
        return None
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine
    except Exception:  # a broken or partial install: a plain Engine
        return None
    cls = _CLASSES.get(DeepSpeedEngine)
    if cls is not None:
        return cls
    own = _engine_names()
    namespace: dict[str, Any] = {
        "__module__": __name__,
        "__qualname__": "DeepSpeedCompatibleEngine",
        "__doc__": "flatzero's ``Engine``, an instance of ``deepspeed.DeepSpeedEngine`` too "
        "(see ``flatzero.deepspeed.engine.deepspeed_compat``).",
        "__del__": lambda self: None,
    }
    for name, value in vars(DeepSpeedEngine).items():
        if name.startswith("__") or name in own or name in namespace:
            continue
        if callable(value) or isinstance(value, (property, staticmethod, classmethod)):
            namespace[name] = not_implemented(name)
    cls = type("DeepSpeedCompatibleEngine", (Engine, DeepSpeedEngine), namespace)
    _CLASSES[DeepSpeedEngine] = cls
    globals()["DeepSpeedCompatibleEngine"] = cls  # pickle finds classes by qualified name
    return cls
