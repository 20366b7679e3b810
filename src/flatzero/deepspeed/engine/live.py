"""The engines ``initialize`` built in this process that still train, and handing a model's
params from one of them to a new engine.

See the note beside ``release_engines_over``.
"""

from __future__ import annotations

import logging
import weakref

from torch import nn

from .engine import Engine

__all__ = ["release_engines_over", "track"]

logger = logging.getLogger(__name__)

_LIVE: weakref.WeakSet[Engine] = weakref.WeakSet()
"""Engines built by ``initialize`` that the user still references (weakly held)."""


def track(engine: Engine) -> None:
    """Remember ``engine`` until it is collected."""
    _LIVE.add(engine)


# [Note: a second engine over a live engine's model.
# DeepSpeed builds a second engine over a model a first engine still trains (its checkpoint
# tests load into "a fresh ds engine" over the same model, the first one still referenced).
# flatzero's optimizer refuses params another open optimizer hooks (``check_unclaimed``:
# both would take each gradient), so the door destroys the old engine first, with a
# warning: its gradient hooks go, its module stays (the new engine's), and it cannot train
# after. Only engines of this door are released; a ``ZeroOptimizer`` built directly is
# still refused.]
def release_engines_over(model: nn.Module) -> None:
    """``destroy()`` every live engine that trains one of ``model``'s params (warning once
    per engine)."""
    ours = {id(p) for p in model.parameters()}
    for engine in list(_LIVE):
        if engine._destroyed or not any(id(p) in ours for p in engine.module.parameters()):
            continue
        logger.warning(
            "flatzero.initialize: the model's params are trained by another engine; that "
            "engine is destroyed (engine.destroy(): its gradient hooks removed, it cannot "
            "train after) and the new one takes them"
        )
        engine.destroy()
        _LIVE.discard(engine)
