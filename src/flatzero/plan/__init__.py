"""``flatzero plan``: per-rank memory, the tier ``auto`` takes, bytes per link and init time
of a job, predicted from a model config and a cluster shape before any GPU is booked.

See docs/plan.md for the model and its assumptions.
"""

from .calibration import Calibration, measure
from .hardware import GPUS, HOSTS, GpuSpec, HostSpec, get_gpu, get_host
from .memory_model import InitMemory, ModelStates, model_states
from .model_source import ModelSource, config_from_hf, resolve_model
from .planner import MethodPlan, Plan, PlanSpec, make_plan
from .report import format_plan, plan_to_dict

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
