"""``flatzero plan``: per-rank memory, the tier ``auto`` takes, bytes per link and init time
of a job, predicted from a model config and a cluster shape before any GPU is booked.

See docs/plan.md for the model and its assumptions. The names below load on first use (as
``flatzero``'s do): ``flatzero.plan.options`` builds ``flatzero plan --help`` without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .calibration import Calibration, measure
    from .hardware import GPUS, HOSTS, GpuSpec, HostSpec, get_gpu, get_host
    from .memory_model import InitMemory, ModelStates, model_states
    from .model_source import ModelSource, config_from_hf, resolve_model
    from .planner import MethodPlan, Plan, PlanSpec, make_plan
    from .report import format_plan, plan_to_dict

_WHERE: dict[str, str] = {
    "Calibration": ".calibration",
    "measure": ".calibration",
    "GPUS": ".hardware",
    "HOSTS": ".hardware",
    "GpuSpec": ".hardware",
    "HostSpec": ".hardware",
    "get_gpu": ".hardware",
    "get_host": ".hardware",
    "InitMemory": ".memory_model",
    "ModelStates": ".memory_model",
    "model_states": ".memory_model",
    "ModelSource": ".model_source",
    "config_from_hf": ".model_source",
    "resolve_model": ".model_source",
    "MethodPlan": ".planner",
    "Plan": ".planner",
    "PlanSpec": ".planner",
    "make_plan": ".planner",
    "format_plan": ".report",
    "plan_to_dict": ".report",
}
"""Each public name and the module it lives in."""

__all__ = [
    "GPUS",
    "HOSTS",
    "Calibration",
    "GpuSpec",
    "HostSpec",
    "InitMemory",
    "MethodPlan",
    "ModelSource",
    "ModelStates",
    "Plan",
    "PlanSpec",
    "config_from_hf",
    "format_plan",
    "get_gpu",
    "get_host",
    "make_plan",
    "measure",
    "model_states",
    "plan_to_dict",
    "resolve_model",
]
"""The public names: each is a key of ``_WHERE``."""


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
