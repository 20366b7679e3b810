"""The base optimizer DeepSpeed 0.19's engine builds for a config, and the state it reads.

See the note beside ``BaseOptimizer``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "CPU_ADAM",
    "FUSED_ADAM",
    "MUON",
    "BaseOptimizer",
    "configured_optimizer",
    "default_optimizer",
    "kernel_group",
    "kernel_hyper_problem",
    "kernel_scalar",
    "offloaded",
]

FUSED_ADAM = "FusedAdam"
"""``deepspeed.ops.adam.FusedAdam``: DeepSpeed's Adam/AdamW without ``torch_adam`` or offload."""
CPU_ADAM = "DeepSpeedCPUAdam"
"""``deepspeed.ops.adam.DeepSpeedCPUAdam``: DeepSpeed's Adam/AdamW with optimizer offload."""

MUON = "MuonWithAuxAdam"
"""DeepSpeed's ``Muon`` config: Muon on the ``use_muon`` groups, FusedAdam on the others
(``flatzero.deepspeed.muon_state``); flatzero's checkpoint records ``DeepSpeedMuon``."""

_KERNEL_KEYS: dict[str, dict[str, Any]] = {
    FUSED_ADAM: {"bias_correction": True, "step": 0},
    CPU_ADAM: {"bias_correction": True, "amsgrad": False},
}
"""Per DeepSpeed Adam class, the param-group keys it reads that torch's Adam/AdamW groups
lack, with the values that continue torch's update (torch always corrects the bias;
FusedAdam keeps a group ``step`` of 0 beside the per-param one and never advances it)."""

_OFFLOAD_DEVICES = ("cpu", "nvme")


# [Note: which optimizer, and the state it loads.
# DeepSpeed builds its base optimizer from the config's ``optimizer`` section
# (``engine._configure_basic_optimizer`` / ``get_optimizer_configuration``): for ``Adam`` and
# ``AdamW``, ``torch.optim.AdamW`` (``Adam`` when neither the type is AdamW nor
# ``adam_w_mode`` is left true) with ``params.torch_adam``; else ``DeepSpeedCPUAdam`` when
# ``zero_optimization.offload_optimizer.device`` is cpu or nvme; else ``FusedAdam``. Its
# resume is torch's ``Optimizer.load_state_dict``, which replaces each param group's
# hyperparameters with the saved group's, so the saved groups must carry every key the class
# reads: FusedAdam reads ``lr``, ``bias_correction``, ``betas``, ``eps``, ``weight_decay``
# (``adam_w_mode`` is the instance's, from the config); DeepSpeedCPUAdam also ``amsgrad``.
# Both keep the per-param ``step`` as a Python int (their kernels take an int), with
# ``exp_avg`` and ``exp_avg_sq`` shaped and typed as the fp32 master partition.
#
# Such a group is written as the union of torch's keys (as the flatzero checkpoint recorded
# them) and the DeepSpeed class's: the update of either kernel equals torch's Adam/AdamW
# with the same hyperparameters, and the same file also resumes a client
# ``torch.optim.AdamW`` (torch's ``__setstate__`` turns an int ``step`` into its tensor and
# keeps ``decoupled_weight_decay``, which a group without it would default to False).]
@dataclass(frozen=True)
class BaseOptimizer:
    """The base optimizer of the DeepSpeed run an export is for.

    Attributes:
        name: the class DeepSpeed builds: ``FUSED_ADAM``, ``CPU_ADAM``, or a
            ``torch.optim`` class name (its state is written as torch's ``state_dict``).
        torch_name: the ``torch.optim`` class whose update it computes (``AdamW`` or
            ``Adam`` for DeepSpeed's Adam kernels, by ``adam_w_mode``): what the flatzero
            checkpoint must have trained with.
    """

    name: str
    torch_name: str

    @property
    def kernel(self) -> bool:
        """Whether it is one of DeepSpeed's Adam kernels (not a ``torch.optim`` class)."""
        return self.name in _KERNEL_KEYS

    @property
    def muon(self) -> bool:
        """Whether it is DeepSpeed's Muon (``MUON``), whose Adam groups are FusedAdam's."""
        return self.name == MUON

    def describe(self) -> str:
        """Its name as a user reads it (``torch.optim.AdamW``, ``FusedAdam (AdamW)``)."""
        if self.kernel:
            return f"{self.name} ({self.torch_name})"
        if self.muon:
            return f"DeepSpeed's Muon ({self.name})"
        return f"torch.optim.{self.name}"

    def config_section(self) -> dict[str, Any]:
        """A config ``optimizer`` section that makes DeepSpeed build this Adam kernel (or
        its Muon) without offload (stored as the export's ``ds_config`` when none is
        given)."""
        if self.muon:
            return {"type": "Muon", "params": {}}
        params = {} if self.torch_name == "AdamW" else {"adam_w_mode": False}
        return {"type": self.torch_name, "params": params}


def offloaded(config: Mapping[str, Any]) -> bool:
    """Whether DeepSpeed runs the optimizer on the host (``zero_use_cpu_optimizer``)."""
    zero = config.get("zero_optimization") or {}
    offload = zero.get("offload_optimizer")
    device = offload.get("device") if isinstance(offload, Mapping) else None
    return str(device).lower() in _OFFLOAD_DEVICES or zero.get("cpu_offload") is True


def configured_optimizer(config: Mapping[str, Any]) -> BaseOptimizer | None:
    """The base optimizer DeepSpeed builds for ``config``'s ``optimizer`` section of type
    Adam or AdamW; None for another type or without the section (the caller's)."""
    section = config.get("optimizer")
    if not isinstance(section, Mapping) or str(section.get("type", "")).lower() not in (
        "adam",
        "adamw",
    ):
        return None
    params = section.get("params") or {}
    adamw = str(section["type"]).lower() == "adamw" or params.get("adam_w_mode", True)
    torch_name = "AdamW" if adamw else "Adam"
    if params.get("bias_correction", True) is False:
        raise ValueError(
            "ds_config optimizer.params.bias_correction is false, but a flatzero checkpoint "
            "is trained with torch's Adam, which always corrects the bias; remove the key"
        )
    if params.get("torch_adam", False):
        return BaseOptimizer(torch_name, torch_name)
    return BaseOptimizer(CPU_ADAM if offloaded(config) else FUSED_ADAM, torch_name)


def default_optimizer(recorded: str | None) -> BaseOptimizer | None:
    """DeepSpeed's default for the optimizer a flatzero checkpoint recorded: FusedAdam for
    Adam and AdamW (what a config ``optimizer`` section of that type builds without offload
    or ``torch_adam``), DeepSpeed's Muon for ``DeepSpeedMuon`` (the DeepSpeed door's
    ``Muon``), the class itself for another; None when none is recorded (an imported
    checkpoint: its state is written as it was read)."""
    if recorded is None:
        return None
    if recorded == "DeepSpeedMuon":
        return BaseOptimizer(MUON, recorded)
    if recorded in ("Adam", "AdamW"):
        return BaseOptimizer(FUSED_ADAM, recorded)
    return BaseOptimizer(recorded, recorded)


def kernel_hyper_problem(
    hyper: Mapping[str, Any], states: tuple[str, ...], torch_name: str
) -> str | None:
    """Why a group (torch hyperparameters, per-element state names) cannot continue in
    DeepSpeed's Adam kernels computing ``torch_name``'s update; None when it can."""
    for key in ("amsgrad", "maximize"):
        if hyper.get(key, False):
            return f"{key}=True, which FusedAdam and DeepSpeedCPUAdam do not implement"
    decoupled = torch_name == "AdamW"
    if hyper.get("decoupled_weight_decay", decoupled) != decoupled:
        return (
            f"decoupled_weight_decay={not decoupled}, the other mode (adam_w_mode) than "
            f"{torch_name}'s"
        )
    extra = sorted(set(states) - {"exp_avg", "exp_avg_sq"})
    if extra:
        return f"state {extra} beside exp_avg and exp_avg_sq, which they do not keep"
    return None


def kernel_group(hyper: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A param group (without ``params``) for DeepSpeed's Adam class ``name``: torch's
    keys and the class's own (see the note above)."""
    return {**hyper, **{k: v for k, v in _KERNEL_KEYS[name].items() if k not in hyper}}


def kernel_scalar(name: str, value: Any) -> Any:
    """A scalar state as DeepSpeed's Adam kernels keep it: ``step`` as an int."""
    if name == "step" and isinstance(value, (torch.Tensor, float)):
        return int(value.item() if isinstance(value, torch.Tensor) else value)
    return value
