"""Which optimizer ``flatzero.initialize`` runs over the flat shards: the config's
``optimizer`` section, or a client optimizer (an instance, or a function of the params), as
``deepspeed.initialize`` accepts; and where the param groups come from."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...comm import rank_of
from ...optim import ZeroOptimizer
from ...optim.inner import check_optimizer_class
from ...optim.offload import check_host_kernel
from ...params import ParamGroup
from .config import EngineConfig
from .errors import UnsupportedFeatureError
from .muon_groups import muon_param_groups

__all__ = ["OptimizerChoice", "choose_optimizer"]

logger = logging.getLogger(__name__)

_DEFAULT_LR = 1e-3
"""torch.optim's usual default learning rate, for a group that names none."""


@dataclass(frozen=True)
class OptimizerChoice:
    """The optimizer class ``initialize`` builds, its arguments and its param groups.

    Attributes:
        cls: the ``torch.optim`` class.
        defaults: its keyword arguments (the config's ``optimizer.params``; none for a
            client optimizer, whose param groups carry them).
        name: the class and where it came from, for the report (``"AdamW (client)"``).
        params: what the param groups are collected from (``collect_param_groups``): the
            client's ``param_groups``, ``model_parameters``, or the model.
        where: what ``params`` is called in errors.
        client: the client optimizer, or None.
    """

    cls: type[torch.optim.Optimizer]
    defaults: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    params: Any = None
    where: str = "model_parameters"
    client: torch.optim.Optimizer | None = None

    def lr_of(self, group: ParamGroup) -> float:
        """The learning rate ``group`` starts with."""
        return float(group.options.get("lr", self.defaults.get("lr", _DEFAULT_LR)))


def _built_client(optimizer: Any, model: nn.Module, model_parameters: Any) -> torch.optim.Optimizer:
    """The client optimizer instance (built from the params when a callable is given),
    checked to be fresh and not flatzero's own."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, or a callable taking the params "
                f"and returning one, got {type(optimizer).__name__}"
            )
        params = model_parameters if model_parameters is not None else model.parameters()
        optimizer = optimizer(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"the optimizer callable returned a {type(optimizer).__name__}, not a "
                "torch.optim.Optimizer"
            )
    if isinstance(optimizer, ZeroOptimizer):
        raise TypeError(
            "optimizer is already a ZeroOptimizer; pass the model and a plain torch.optim "
            "optimizer (or a config 'optimizer' section) to flatzero.initialize"
        )
    if any(optimizer.state.values()):
        raise ValueError(
            f"the {type(optimizer).__name__} passed as optimizer already has state (it has "
            "stepped); flatzero builds its own optimizer over the flat shards and cannot carry "
            "that state over: pass a fresh optimizer, and restore state with "
            "engine.load_checkpoint"
        )
    return optimizer


def _deepspeed_adam(client: torch.optim.Optimizer) -> tuple[type, list[dict[str, Any]]] | None:
    """DeepSpeed's ``FusedAdam`` (elementwise Adam in one kernel) as the torch class that
    computes the same update and the client's groups without ``bias_correction``; None for
    any other optimizer.

    ``adam_w_mode`` picks ``AdamW`` (decoupled weight decay) or ``Adam`` (L2 added to the
    gradient), as FusedAdam's kernel does; ``lr``, ``betas``, ``eps`` and ``weight_decay`` are
    torch's keys already. torch's Adam always corrects the bias: a group with
    ``bias_correction: False`` is an ``UnsupportedFeatureError`` (DeepSpeed runs it).
    """
    cls = type(client)
    if cls.__name__ != "FusedAdam" or not cls.__module__.startswith("deepspeed."):
        return None
    if not all(g.get("bias_correction", True) for g in client.param_groups):
        raise UnsupportedFeatureError(
            "optimizer: FusedAdam with bias_correction=False has no torch.optim counterpart "
            "(torch's Adam always corrects the bias)",
            key="optimizer",
            feature="FusedAdam without bias correction",
        )
    torch_cls = torch.optim.AdamW if getattr(client, "adam_w_mode", 1) else torch.optim.Adam
    groups = [{k: v for k, v in g.items() if k != "bias_correction"} for g in client.param_groups]
    return torch_cls, groups


def _client_choice(
    optimizer: Any, cfg: EngineConfig, model: nn.Module, model_parameters: Any
) -> OptimizerChoice:
    client = _built_client(optimizer, model, model_parameters)
    mapped = _deepspeed_adam(client)
    if mapped is not None:
        cls, groups = mapped
        name = f"{cls.__name__} (client FusedAdam)"
    else:
        cls, groups, name = type(client), client.param_groups, f"{type(client).__name__} (client)"
        try:
            check_optimizer_class(cls, elementwise=cfg.flatzero.elementwise_optimizer or None)
        except TypeError as error:
            raise UnsupportedFeatureError(
                f"optimizer: {error}", key="optimizer", feature=f"the {cls.__name__}"
            ) from None
    if cfg.zero_optimizer.offload_optimizer is not None:
        options = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        check_host_kernel(cls, options, {})
    return OptimizerChoice(
        cls, name=name, params=groups, where="optimizer.param_groups", client=client
    )


def choose_optimizer(
    optimizer: Any, cfg: EngineConfig, model: nn.Module, model_parameters: Any
) -> OptimizerChoice:
    """The optimizer of ``initialize``: the client's, else the config's. Given both, the
    client's is used and the config's section ignored, with a warning, as DeepSpeed does.

    Raises:
        UnsupportedFeatureError: no optimizer at all, or a client optimizer that is not
            elementwise.
        ValueError / TypeError: a bad client optimizer (with optimizer offload: one that
            cannot step host tensors).
    """
    if optimizer is not None:
        if cfg.optimizer is not None and rank_of(None) == 0:
            logger.warning(
                "flatzero.initialize: an optimizer was passed and the config has an "
                "'optimizer' section (%s); the passed optimizer is used and the section "
                "ignored, as DeepSpeed does",
                cfg.optimizer.type,
            )
        return _client_choice(optimizer, cfg, model, model_parameters)
    if cfg.optimizer is None:
        raise UnsupportedFeatureError(
            "flatzero.initialize needs an optimizer: add an 'optimizer' section to the config "
            "(e.g. {'type': 'AdamW', 'params': {'lr': 1e-4}}) or pass optimizer=",
            key="optimizer",
            feature="an engine without an optimizer",
        )
    if isinstance(model_parameters, torch.Tensor):
        model_parameters = [model_parameters]
    cls = cfg.optimizer.torch_class
    if cfg.optimizer.torch_name == "Muon":
        if cfg.zero_optimizer.offload_optimizer is not None:
            raise UnsupportedFeatureError(
                "optimizer: the Muon config with zero_optimization.offload_optimizer: flatzero "
                "runs Muon's Newton-Schulz on the device shards only; drop the offload",
                key="optimizer",
                feature="Muon with optimizer offload",
            )
        groups, defaults = muon_param_groups(model, model_parameters, cfg.optimizer.kwargs())
        name = f"{cls.__name__} (config {cfg.optimizer.type})"
        return OptimizerChoice(cls, defaults, name, groups)
    return OptimizerChoice(
        cls,
        cfg.optimizer.kwargs(),
        f"{cls.__name__} (config {cfg.optimizer.type})",
        model if model_parameters is None else model_parameters,
    )
