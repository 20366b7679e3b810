"""Plain ``loss.backward()`` instead of ``engine.backward(loss)``, as DeepSpeed 0.19.8 runs it.

See the note beside ``UserBackward``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

__all__ = ["UNSCALED", "UserBackward"]

UNSCALED = (
    "loss.backward() without the loss scale: this engine trains in fp16 with loss scaling, "
    "and an unscaled backward would give gradients divided by the loss scale at the step; "
    "call engine.backward(loss), or engine.scale(loss).backward()"
)
"""The error of a plain backward that fp16 loss scaling needs scaled (DeepSpeed raises a
``RuntimeError`` there too: "Loss scaling is required ...")."""


# [Note: plain loss.backward() through the DeepSpeed door. DeepSpeed 0.19.8 lets a script
# call ``loss.backward()`` (or ``out.backward(grad)``) on what ``engine(...)`` returned
# instead of ``engine.backward(loss)``: its gradient hooks reduce as usual, ``engine.step()``
# steps, and the gradients are divided by ``gradient_accumulation_steps`` as
# ``engine.backward`` divides the loss (DeepSpeed hooks the forward's outputs for that).
# With fp16 loss scaling an unscaled backward is a ``RuntimeError`` naming
# ``engine.backward(loss)`` and ``engine.scale(loss).backward()``; ``engine.scale(loss)``
# multiplies by the loss scale only (the division by the accumulation steps still happens).
#
# flatzero divides where the gradient arrives at each trainable param: a hook per param
# (``register_hook``, before autograd accumulates it) returns ``grad / gas`` in a backward
# that ``engine.backward`` did not start. That is once per param whatever path the gradient
# took (DeepSpeed divides at every output tensor, so a gradient through two outputs that
# depend on each other, a ``ModelOutput``'s ``loss`` and ``logits``, is divided twice); it
# is bit for bit DeepSpeed's when ``gas`` is a power of two (the division is exact) and
# within rounding otherwise. The fp16 check is the same hooks': unless ``engine.scale`` was
# called since the last forward, the first gradient of the backward raises, before anything
# was accumulated. Without accumulation and without fp16 loss scaling there are no hooks.]
class UserBackward:
    """The param hooks that make a plain ``loss.backward()`` what ``engine.backward`` does.

    Attributes:
        gas: ``gradient_accumulation_steps``: a plain backward's gradients are divided by it.
        needs_scale: fp16 loss scaling: a plain backward must come from ``engine.scale``.
    """

    def __init__(self, params: Sequence[nn.Parameter], gas: int, needs_scale: bool) -> None:
        self.gas = gas
        self.needs_scale = needs_scale
        self._in_engine_backward = False
        self._scaled = False
        hooked = gas > 1 or needs_scale
        self._handles = [p.register_hook(self._hook) for p in params] if hooked else []

    @contextlib.contextmanager
    def engine_backward(self) -> Iterator[None]:
        """While ``engine.backward`` runs its backward: the hooks leave the gradients alone
        (its loss is divided and scaled already)."""
        self._in_engine_backward = True
        try:
            yield
        finally:
            self._in_engine_backward = False

    def forward_started(self) -> None:
        """A new forward: a scale from ``engine.scale`` before it no longer counts."""
        self._scaled = False

    def scaled(self) -> None:
        """``engine.scale(loss)`` was called: the next plain backward is scaled."""
        self._scaled = True

    def _hook(self, grad: torch.Tensor) -> torch.Tensor | None:
        if self._in_engine_backward:
            return None
        if self.needs_scale and not self._scaled:
            raise RuntimeError(UNSCALED)
        return grad / self.gas if self.gas > 1 else None

    def close(self) -> None:
        """Remove the hooks (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
