"""The wrapped ``torch.optim`` optimizer: which classes can run on one flat tensor, and building it.

``ZeroOptimizer`` hands the inner optimizer one flat 1-D fp32 tensor per group (this rank's
master shard). That is only the same optimizer as on the original params when its update
of an element depends on that element's own gradient and state alone (elementwise), as
for Adam, AdamW, SGD, Adagrad, RMSprop and the like. Optimizers that step each param as a
whole (Muon, Adafactor) get whole params: the layout puts every param whole on one owner
rank (``FlattenConfig.whole_params``) and ``whole.WholeParamsOptimizer`` steps them as views
of the shard. Optimizers that look at all params at once would silently compute something
else and are refused.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..hostmem import HugePageFactories
from .deepspeed_muon import DeepSpeedMuon
from .whole import WholeParamsOptimizer, WholePiece

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "WHOLE_PARAM_OPTIMIZERS",
    "build_inner_optimizer",
    "check_optimizer_class",
    "needs_whole_params",
    "optimizer_class_of",
    "scale_grads",
    "step_with_grad_scale",
    "takes_grad_scale",
    "whole_groups",
    "with_fused_default",
]

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "NAdam",
        "RAdam",
        "Adagrad",
        "Adadelta",
        "RMSprop",
        "Rprop",
        "ASGD",
    )
    if hasattr(torch.optim, name)
)
"""``torch.optim`` classes whose update is elementwise: they work on a flat shard."""

WHOLE_PARAM_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    *(getattr(torch.optim, name) for name in ("Muon", "Adafactor") if hasattr(torch.optim, name)),
    DeepSpeedMuon,
)
"""Classes that step each param as a whole (``torch.optim``'s, and DeepSpeed's Muon update):
they run on whole params, each on its owner rank (``whole.WholeParamsOptimizer``)."""

_REFUSED: dict[str, str] = {
    "LBFGS": (
        "it needs a closure and runs a line search over all parameters at once, which "
        "sharded flat tensors cannot provide"
    ),
    "SparseAdam": "it needs sparse gradients, and flat gradient shards are dense",
}


def _optimizer_class(optimizer: Any) -> type:
    """The class behind ``optimizer`` (a class or a ``functools.partial`` of one)."""
    target = optimizer
    while isinstance(target, functools.partial):
        target = target.func
    if isinstance(target, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer is an instance of {type(target).__name__}; ZeroOptimizer builds the "
            "optimizer over its flat shards itself: pass the class (optimizer="
            f"torch.optim.{type(target).__name__}) and its arguments (lr=..., ...) instead"
        )
    if not isinstance(target, type) or not issubclass(target, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer subclass such as torch.optim.AdamW "
            f"(or a functools.partial of one), got {optimizer!r}"
        )
    return target


def check_optimizer_class(optimizer: Any, *, elementwise: bool | None = None) -> type:
    """Check that ``optimizer`` can run on flat 1-D shards; returns the optimizer class.

    Args:
        optimizer: a ``torch.optim.Optimizer`` subclass or a ``functools.partial`` of one.
        elementwise: ``True`` asserts that the class's update is elementwise (allows a
            class flatzero does not know); ``None`` accepts only ``ELEMENTWISE_OPTIMIZERS``.

    Raises:
        TypeError: not an optimizer class, an instance, or a class that cannot work on a
            flat tensor (named, with the reason and the fix).
    """
    cls = _optimizer_class(optimizer)
    for base in cls.__mro__:
        reason = _REFUSED.get(base.__name__)
        if reason is not None and base.__module__.startswith("torch.optim"):
            raise TypeError(
                f"{cls.__name__} cannot be used with ZeroOptimizer: {reason}. Use an "
                "elementwise optimizer such as torch.optim.AdamW, Adam, SGD, Adagrad or RMSprop"
            )
    if cls in ELEMENTWISE_OPTIMIZERS or elementwise or needs_whole_params(cls):
        return cls
    raise TypeError(
        f"ZeroOptimizer does not know whether {cls.__module__}.{cls.__qualname__} updates each "
        "element from its own gradient and state only; it runs the optimizer on one flat 1-D "
        "shard per param group, which computes the same thing only for such elementwise "
        "optimizers. If it is elementwise, pass elementwise_optimizer=True; known ones are "
        + ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    )


def needs_whole_params(optimizer: Any) -> bool:
    """Whether ``optimizer`` (a class or a ``functools.partial`` of one) steps whole params
    (``WHOLE_PARAM_OPTIMIZERS`` or a subclass)."""
    return issubclass(_optimizer_class(optimizer), WHOLE_PARAM_OPTIMIZERS)


def whole_groups(optimizer: Any, group_options: Sequence[Mapping[str, Any]]) -> tuple[bool, ...]:
    """Per param group, whether ``optimizer`` steps its params whole. A class with a
    ``whole_group_option`` (``DeepSpeedMuon``'s ``use_muon``) steps whole only the groups
    whose option is true, the others elementwise on flat slices."""
    if not needs_whole_params(optimizer):
        return tuple(False for _ in group_options)
    option = getattr(_optimizer_class(optimizer), "whole_group_option", None)
    return tuple(option is None or bool(o.get(option, False)) for o in group_options)


def optimizer_class_of(inner: torch.optim.Optimizer) -> type:
    """The user's optimizer class behind an inner optimizer (the wrapped class of a
    ``WholeParamsOptimizer``)."""
    return inner.whole_class if isinstance(inner, WholeParamsOptimizer) else type(inner)


def _fused_devices() -> tuple[str, ...]:
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices
    except ImportError:  # older or newer torch without the helper: be conservative
        return ("cuda",)
    return tuple(_get_fused_kernels_supported_devices())


_IMPLEMENTATIONS = ("fused", "foreach")
"""Arguments choosing a ``torch.optim`` implementation; ``None`` (their default) chooses none."""


def _chooses_implementation(settings: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any of ``settings`` (keyword arguments, group options) chooses ``fused`` or
    ``foreach`` (a value other than ``None``) or asks for ``differentiable``, which a fused
    kernel refuses."""
    return any(
        any(s.get(k) is not None for k in _IMPLEMENTATIONS) or s.get("differentiable")
        for s in settings
    )


def with_fused_default(
    optimizer: Any,
    defaults: dict[str, Any],
    group_options: Sequence[Mapping[str, Any]],
    device: torch.device,
) -> dict[str, Any]:
    """``defaults`` plus ``fused=True`` when the optimizer has a fused kernel for ``device``
    and neither its keyword arguments nor any group's options choose an implementation.

    Only a value chooses: ``fused=None``/``foreach=None`` are torch's defaults, which a
    client optimizer's ``param_groups`` and ``defaults`` carry whether or not its user
    chose anything (``torch.optim.AdamW(params, lr=...)`` has both). The inner optimizer
    steps one flat tensor per group: exactly what fused kernels are for. The single-tensor
    fallback of ``torch.optim`` allocates temporaries the size of the whole shard every
    step (several times slower on a large flat tensor).
    """
    keywords = dict(getattr(optimizer, "keywords", None) or {})
    if _chooses_implementation([keywords, defaults, *group_options]):
        return defaults
    if "fused" not in inspect.signature(_optimizer_class(optimizer).__init__).parameters:
        return defaults
    if device.type not in _fused_devices():
        return defaults
    return {**defaults, "fused": True}


def _without_unchosen(options: Mapping[str, Any]) -> dict[str, Any]:
    """A group's options less ``fused``/``foreach`` set to ``None`` (chosen nothing), so
    that the optimizer's defaults apply to the group."""
    return {k: v for k, v in options.items() if not (k in _IMPLEMENTATIONS and v is None)}


_GRAD_SCALE_STEPS = {
    inspect.unwrap(getattr(torch.optim, name).step)
    for name in ("Adam", "AdamW", "SGD", "Adagrad")
    if hasattr(torch.optim, name)
}


def takes_grad_scale(inner: torch.optim.Optimizer) -> bool:
    """Whether ``inner.step()`` divides the gradients by ``inner.grad_scale`` in its fused
    kernel (torch's Adam, AdamW, SGD, Adagrad with ``fused=True`` in every group)."""
    return inspect.unwrap(type(inner).step) in _GRAD_SCALE_STEPS and all(
        g.get("fused") for g in inner.param_groups
    )


def step_with_grad_scale(inner: torch.optim.Optimizer, grad_scale: torch.Tensor | None) -> None:
    """``inner.step()``, its fused kernel dividing every gradient by ``grad_scale`` as it
    reads it (``takes_grad_scale``); None: a plain step. A step that makes state (the
    first) makes the state of host shards on huge pages (``hostmem.HugePageFactories``)."""
    placement = HugePageFactories() if _makes_state(inner) else contextlib.nullcontext()
    if grad_scale is None:
        with placement:
            inner.step()
        return
    inner.grad_scale = grad_scale  # type: ignore[attr-defined]
    try:
        with placement:
            inner.step()
    finally:
        inner.grad_scale = None  # type: ignore[attr-defined]


def scale_grads(
    inner: torch.optim.Optimizer, grads: Sequence[torch.Tensor], coef: float | torch.Tensor
) -> torch.Tensor | None:
    """Make ``inner``'s next step see ``grads`` (its params' gradients) times ``coef``: the
    fused kernel's ``grad_scale``, ``1 / coef`` (it divides by it as it reads the gradient:
    no extra pass; a 0-d fp32 tensor on the gradients' device, made there: a fill, not a
    copy from the host), else the gradients multiplied in place and None."""
    if not isinstance(coef, torch.Tensor) and coef == 1.0:
        return None
    if takes_grad_scale(inner):
        if isinstance(coef, torch.Tensor):
            return coef.reciprocal()
        return torch.full((), 1.0 / coef, dtype=torch.float32, device=grads[0].device)
    torch._foreach_mul_(list(grads), coef)
    return None


def _makes_state(inner: torch.optim.Optimizer) -> bool:
    """Whether ``inner.step()`` may create state: some param was never stepped nor loaded
    (a step enters every param in ``inner.state``, even one it keeps no state for)."""
    return any(p not in inner.state for g in inner.param_groups for p in g["params"])


def build_inner_optimizer(
    optimizer: Callable[..., torch.optim.Optimizer],
    shards: Sequence[nn.Parameter],
    group_options: Sequence[dict[str, Any]],
    defaults: dict[str, Any],
    whole: Sequence[Sequence[WholePiece]] | None = None,
) -> torch.optim.Optimizer:
    """Build ``optimizer`` over one param group per flat master shard.

    Args:
        optimizer: the checked optimizer class (or partial).
        shards: one fp32 master shard per group, as ``nn.Parameter`` with ``.grad`` set.
        group_options: per group, the user's hyperparameters (``lr``, ``weight_decay``, ...);
            ``fused=None``/``foreach=None`` in them are dropped, so ``defaults`` decide.
        defaults: keyword arguments for the optimizer (its defaults for every group).
        whole: for an optimizer that ``needs_whole_params``, per group the whole params
            this rank owns in its shard (``None``: a probe, none).

    State made at construction (``Adagrad``'s sums) goes on huge pages for host shards, as a
    first step's does (``step_with_grad_scale``).
    """
    groups = [
        {**_without_unchosen(options), "params": [shard]}
        for shard, options in zip(shards, group_options, strict=True)
    ]
    try:
        with HugePageFactories():
            if needs_whole_params(optimizer):
                options = [_without_unchosen(o) for o in group_options]
                return WholeParamsOptimizer(optimizer, shards, options, defaults, whole)
            return optimizer(groups, **defaults)
    except TypeError as error:
        name = _optimizer_class(optimizer).__name__
        raise TypeError(
            f"building {name} over the flat shards failed: {error}. Keyword arguments other "
            "than ZeroOptimizer's own (stage, process_group, config, flatten_config, "
            f"elementwise_optimizer) are passed to {name}; check their names"
        ) from error
