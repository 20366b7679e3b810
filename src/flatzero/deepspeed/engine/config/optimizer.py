"""Parsing the ``optimizer`` and ``scheduler`` sections of a DeepSpeed config into the
specs ``initialize`` builds them from."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..schedulers import SCHEDULERS
from .keys import ADAM_KEYS, SGD_KEYS
from .reader import Section, fmt
from .schema import OptimizerSpec, SchedulerSpec

__all__ = ["parse_optimizer", "parse_scheduler"]

_FOREACH = "the optimizer runs on one flat tensor per group"


def _read_betas(p: Section) -> tuple[float, float] | None:
    value = p.raw("betas", None)
    if value is None:
        return None
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        raise p.fail("betas", value, "it must be a list of two numbers", "e.g. [0.9, 0.999]")
    return (float(value[0]), float(value[1]))


def _adam_params(p: Section, lower: str) -> tuple[str, dict[str, Any]]:
    """The ``torch.optim`` class name and arguments of DeepSpeed's Adam/AdamW."""
    adam_w_mode = p.bool("adam_w_mode", True)
    torch_adam = p.bool("torch_adam", False)
    torch_name = "AdamW" if lower == "adamw" or adam_w_mode else "Adam"
    p.no_effect("fp32_optimizer_states", "optimizer states are always fp32")
    p.no_effect("foreach", _FOREACH)
    if not p.bool("bias_correction", True):
        raise p.unsupported(
            "bias_correction",
            False,
            "Adam without bias correction is not available in torch.optim",
            "remove it",
            "Adam without bias correction",
        )
    params: dict[str, Any] = {}
    for name in ADAM_KEYS:
        if name == "betas":
            betas = _read_betas(p)
            if betas is not None:
                params[name] = betas
        elif name == "amsgrad":
            if name in p:
                params[name] = p.bool(name, False)
        elif name in p:
            params[name] = p.number(name, None, minimum=0.0)
    if "weight_decay" not in params and not torch_adam:
        # DeepSpeed's FusedAdam defaults to no weight decay (torch's AdamW to 0.01).
        params["weight_decay"] = 0.0
    return torch_name, params


def _sgd_params(p: Section) -> dict[str, Any]:
    p.no_effect("foreach", _FOREACH)
    params: dict[str, Any] = {}
    for name in SGD_KEYS:
        if name in ("nesterov", "maximize"):
            if name in p:
                params[name] = p.bool(name, False)
        elif name in p:
            params[name] = p.number(name, None, minimum=0.0)
    return params


_MUON_NUMBERS = ("lr", "muon_lr", "adam_lr", "momentum", "weight_decay", "eps")
"""``optimizer.params`` numbers of DeepSpeed's ``Muon`` (its two halves' settings)."""


def _muon_params(p: Section) -> dict[str, Any]:
    """DeepSpeed's ``Muon``: the settings of its Muon and Adam halves, as the config spells
    them (``engine.muon_groups`` splits the params and resolves them per half)."""
    p.no_effect("fp32_optimizer_states", "optimizer states are always fp32")
    p.no_effect("foreach", _FOREACH)
    p.no_effect("torch_adam", "the Adam half runs the same update with or without it")
    p.refuse(
        "per_head_muon",
        bool,
        "it asks for per-head Muon (Newton-Schulz per attention head)",
        "remove it (flatzero orthogonalizes each whole matrix, DeepSpeed's default)",
    )
    params: dict[str, Any] = {"adam_w_mode": p.bool("adam_w_mode", True)}
    for name in _MUON_NUMBERS:
        if name in p:
            params[name] = p.number(name, None, minimum=0.0)
    betas = _read_betas(p)
    if betas is not None:
        params["betas"] = betas
    if "ns_method" in p:
        params["ns_method"] = p.choice("ns_method", "gram", ("gram", "standard"))
    return params


def _typed_section(top: Section, name: str, example: str) -> tuple[Section, str] | None:
    """The section ``name`` and its ``type`` (a string such as ``example``); None when the
    section is absent (null is an error, as in DeepSpeed)."""
    if name not in top:
        return None
    section = top.section(name)
    kind = section.raw("type", None)
    if not isinstance(kind, str):
        raise TypeError(
            f"config key '{name}.type' must be a string such as {example!r}, got {fmt(kind)}"
        )
    return section, kind


def parse_optimizer(top: Section) -> OptimizerSpec | None:
    """``optimizer``: Adam, AdamW, SGD or Muon with DeepSpeed's defaults; None when absent."""
    typed = _typed_section(top, "optimizer", "AdamW")
    if typed is None:
        return None
    opt, kind = typed
    opt.no_effect("legacy_fusion", "no effect")
    p = opt.section("params")
    opt.finish(unknown="error")
    lower = kind.lower()
    if lower not in ("adam", "adamw", "sgd", "muon"):
        raise opt.unsupported(
            "type",
            kind,
            "flatzero's config optimizers are Adam, AdamW, SGD and Muon",
            "use one of them, or build the optimizer yourself and pass it as "
            "flatzero.initialize(optimizer=torch.optim.X(...)) with an elementwise torch.optim "
            "class (Adagrad, RMSprop, ...)",
            f"the {kind} optimizer",
        )
    if "max_grad_norm" in p:
        raise p.fail(
            "max_grad_norm",
            p.data["max_grad_norm"],
            "gradient clipping is not an optimizer parameter",
            "use the top-level key 'gradient_clipping'",
        )
    if lower == "sgd":
        torch_name, params = "SGD", _sgd_params(p)
    elif lower == "muon":
        torch_name, params = "Muon", _muon_params(p)
    else:
        torch_name, params = _adam_params(p, lower)
    p.finish(unknown="error")
    return OptimizerSpec(kind, torch_name, params)


def _scheduler_class(sched: Section, kind: str) -> Any:
    """The class ``scheduler.type`` names: flatzero's warmup schedules or torch's."""
    if kind in SCHEDULERS:
        return SCHEDULERS[kind]
    if kind in ("OneCycle", "LRRangeTest"):
        raise sched.unsupported(
            "type",
            kind,
            f"DeepSpeed's {kind} schedule is not implemented in flatzero (its schedules are "
            f"{', '.join(SCHEDULERS)}, plus any torch.optim.lr_scheduler class)",
            "use one of those, or pass lr_scheduler= to flatzero.initialize",
            f"the {kind} schedule",
        )
    cls = getattr(torch.optim.lr_scheduler, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.lr_scheduler.LRScheduler)):
        raise sched.fail(
            "type",
            kind,
            f"it is neither a DeepSpeed schedule flatzero implements ({', '.join(SCHEDULERS)}) "
            "nor a torch.optim.lr_scheduler class",
            "fix its spelling",
        )
    return cls


def _check_fits(cls: Any, kind: str, p: Section, params: dict[str, Any]) -> None:
    """Every parameter is one ``cls`` takes, and none it needs is missing."""
    signature = inspect.signature(cls)
    accepted = [n for n in signature.parameters if n not in ("self", "optimizer")]
    for name in params:
        if name not in signature.parameters or name == "optimizer":
            raise p.fail(
                name,
                params[name],
                f"{kind} has no such parameter (it takes {', '.join(accepted)})",
                "fix its spelling or remove it",
            )
    try:
        signature.bind(None, **params)
    except TypeError as error:
        raise ValueError(
            f"config key 'scheduler.params' does not fit {kind}: {error}; it takes "
            f"{', '.join(accepted)}"
        ) from None


def parse_scheduler(top: Section) -> SchedulerSpec | None:
    """``scheduler``: a class and arguments that fit it; None when absent."""
    typed = _typed_section(top, "scheduler", "WarmupLR")
    if typed is None:
        return None
    sched, kind = typed
    p = sched.section("params")
    sched.finish(unknown="error")
    cls = _scheduler_class(sched, kind)
    params = {name: p.raw(name) for name in p.data}
    _check_fits(cls, kind, p, params)
    return SchedulerSpec(kind, params)
