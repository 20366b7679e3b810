"""``DeepSpeedMuon``: the update DeepSpeed 0.19.8's ``Muon`` optimizer config runs, as a
``torch.optim`` optimizer (no DeepSpeed import).

DeepSpeed splits every param group into a Muon half (``use_muon: True``: matrices) and an
Adam half (``use_muon: False``: the rest) and steps both with ``MuonWithAuxAdam``:

- Muon half, per matrix: ``momentum.lerp_(grad, 1 - momentum)`` (skipped while the
  gradient is not finite), the Nesterov blend ``grad.lerp(momentum, momentum)``,
  Newton-Schulz orthogonalization (``ns_method``: ``"gram"``, the default, or
  ``"standard"``), times ``sqrt(rows / cols)`` when rows > cols; then
  ``p *= 1 - lr * weight_decay`` and ``p -= lr * update``.
- Adam half: Adam with bias correction, ``eps`` added after the square root (torch's
  ``AdamW`` with ``adam_w_mode``, torch's ``Adam`` with L2 decay without), DeepSpeed's
  defaults ``betas (0.9, 0.95)``, ``eps 1e-10``.

Newton-Schulz runs in DeepSpeed's compute dtypes: ``gram`` in fp16 where the device
multiplies fp16 (CUDA; on the CPU where oneDNN does), else fp32; ``standard`` in bf16.

Under ``ZeroOptimizer`` each Muon group is laid out whole-params
(``whole_group_option``): ``whole.WholeParamsOptimizer`` hands this class each matrix
whole on its owner rank, and the Adam half's flat shard as one 1-D tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["DeepSpeedMuon", "newton_schulz_dtype"]

_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic Newton-Schulz coefficients (a, b, c) DeepSpeed (and Keller Jordan's Muon) use."""

NS_METHODS = ("gram", "standard")

_MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"}
_ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}

NS_STEPS = 5
"""Newton-Schulz iterations per update (DeepSpeed's fixed count)."""


def newton_schulz_dtype(method: str, device: torch.device) -> torch.dtype:
    """The dtype DeepSpeed's Newton-Schulz ``method`` computes in on ``device``'s
    accelerator: ``gram`` fp16 where supported (else fp32), ``standard`` bf16."""
    if method == "standard":
        return torch.bfloat16
    if device.type == "cpu":
        try:
            fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except Exception:  # a build without oneDNN: DeepSpeed's CPU accelerator says no
            fp16 = False
        return torch.float16 if fp16 else torch.float32
    return torch.float16


def _standard(x: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Quintic Newton-Schulz on ``x`` (rows <= cols), in ``dtype``."""
    a, b, c = _COEFFICIENTS
    x = x.to(dtype)
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * s @ s) @ x
    return x


def _gram(x: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Gram Newton-Schulz on ``x`` (rows <= cols): the same polynomial iterated on the
    small Gram matrix ``x @ x.T``, restarted at iteration 2; normalized in ``x``'s dtype,
    iterated in ``dtype``."""
    a, b, c = _COEFFICIENTS
    x = (x / (x.norm() + 1e-7)).to(dtype)
    if x.size(-1) <= x.size(-2):  # square: no saving, the standard iteration
        for _ in range(steps):
            s = x @ x.mT
            x = a * x + (b * s + c * s @ s) @ x
        return x
    gram, q, restart = x @ x.mT, None, 2
    for i in range(steps):
        if i == restart:
            x = q @ x
            gram, q = x @ x.mT, None
        z = b * gram + c * gram @ gram
        if q is None:
            q = z.clone()
            q.diagonal().add_(a)
        else:
            q = a * q + z @ q
        if i < steps - 1 and i + 1 != restart:
            rz = a * gram + z @ gram
            gram = a * rz + z @ rz
    return q @ x


def orthogonalize(update: torch.Tensor, method: str) -> torch.Tensor:
    """DeepSpeed's Newton-Schulz of a matrix ``update`` (4-D conv filters flattened to
    2-D), times ``sqrt(rows / cols)`` of its last two dimensions when rows > cols, in
    ``update``'s dtype."""
    shape = update.shape
    matrix = update.reshape(len(update), -1) if update.dim() == 4 else update
    tall = matrix.size(0) > matrix.size(1)
    x = matrix.mT if tall else matrix
    dtype = newton_schulz_dtype(method, update.device)
    if method == "gram":
        norm_dtype = torch.float32 if x.dtype == torch.float16 else x.dtype
        out = _gram(x.to(norm_dtype), NS_STEPS, dtype)
    else:
        out = _standard(x, NS_STEPS, dtype)
    out = out.mT if tall else out
    rows, cols = shape[-2], shape[-1]  # DeepSpeed's: of the param's last two dimensions
    scale = math.sqrt(rows / cols) if rows > cols else 1.0
    return (out * scale).to(update.dtype).reshape(shape)


class DeepSpeedMuon(torch.optim.Optimizer):
    """DeepSpeed's ``MuonWithAuxAdam`` update over groups tagged ``use_muon``.

    Args:
        params: params or param groups, each group with ``use_muon`` (True: Muon, False:
            Adam) and its options (Muon: ``lr``, ``momentum``, ``weight_decay``,
            ``ns_method``; Adam: ``lr``, ``betas``, ``eps``, ``weight_decay``), DeepSpeed's
            defaults for the rest.
        adam_w_mode: the Adam half decays weights decoupled (AdamW), else as L2 on the
            gradient (Adam).
        use_muon: for a group that does not say.
    """

    whole_group_option = "use_muon"
    """The group option that makes a group need whole params (``inner.whole_groups``)."""

    def __init__(
        self, params: Iterable[Any], adam_w_mode: bool = True, use_muon: bool = True
    ) -> None:
        super().__init__(params, {"adam_w_mode": bool(adam_w_mode), "use_muon": use_muon})
        for group in self.param_groups:
            for key, value in (_MUON_DEFAULTS if group["use_muon"] else _ADAM_DEFAULTS).items():
                group.setdefault(key, value)
            if group["use_muon"] and group["ns_method"] not in NS_METHODS:
                raise ValueError(
                    f"ns_method must be one of {', '.join(NS_METHODS)}, got {group['ns_method']!r}"
                )
        self._updates_ready = False
        """``grads_to_updates`` ran since the last step: Muon matrices hold updates."""

    @torch.no_grad()
    def grads_to_updates(self, scale: float = 1.0) -> None:
        """Replace the gradient of every Muon matrix by its Muon update (momentum step and
        Newton-Schulz), as DeepSpeed's ZeRO optimizer does before the global norm: the
        norm, gradient clipping and the loss scale's unscaling then apply to the update,
        and the next ``step()`` steps each such matrix by its (clipped) ``.grad``.

        Args:
            scale: the gradients are ``1 / scale`` times the averaged, unscaled gradient
                (``ZeroOptimizer``'s shards hold the sum over ranks); the update is stored
                times ``1 / scale`` alike.
        """
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            for p in group["params"]:
                if p.grad is not None and p.dim() >= 2:
                    p.grad.copy_(self._muon_update(p, p.grad * scale, group) / scale)
        self._updates_ready = True

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One update of every param with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ready, self._updates_ready = self._updates_ready, False
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not group["use_muon"]:
                    self._adam(p, group)
                    continue
                update = p.grad  # DeepSpeed's Muon half steps a 1-D param by its gradient
                if p.dim() >= 2 and not ready:
                    update = self._muon_update(p, p.grad, group)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
        return loss

    def _muon_update(
        self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]
    ) -> torch.Tensor:
        """Muon's update of matrix ``p`` from ``grad`` (its momentum stepped); the
        gradient itself where it is not finite (the step is then skipped)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        momentum, beta = state["momentum_buffer"], group["momentum"]
        finite = torch.isfinite(grad).all()
        momentum.copy_(torch.where(finite, momentum.lerp(grad, 1 - beta), momentum))
        update = orthogonalize(grad.lerp(momentum, beta), group["ns_method"])
        return torch.where(finite, update, grad)

    def _adam(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        grad = p.grad
        decoupled = group.get("adam_w_mode", True)
        if not decoupled:
            grad = grad.add(p, alpha=group["weight_decay"])
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] = torch.zeros((), dtype=torch.float32)
        state["step"] += 1
        step = float(state["step"])
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.lerp_(grad.square(), 1 - beta2)
        denom = (exp_avg_sq / (1 - beta2**step)).sqrt_().add_(group["eps"])
        if decoupled:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        p.addcdiv_(exp_avg, denom, value=-group["lr"] / (1 - beta1**step))
