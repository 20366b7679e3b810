"""The names a plan is asked for by: optimizers, where params start, groupings, the fill
size. Plain data with no torch, so that ``flatzero plan --help`` answers at once."""

from __future__ import annotations

from ..layout import DEFAULT_BUCKET_NUMEL

__all__ = [
    "DEFAULT_FILL_BYTES",
    "GROUPINGS",
    "OPTIMIZER_STATES",
    "PARAMS_ON",
    "WHOLE_PARAM_OPTIMIZERS",
]

OPTIMIZER_STATES: dict[str, tuple[int, int]] = {
    "adamw": (2, 1),  # exp_avg, exp_avg_sq; step
    "adam": (2, 1),
    "sgd": (1, 0),  # momentum_buffer (momentum > 0)
    "adagrad": (1, 1),  # sum; step
    "muon": (1, 0),  # momentum_buffer (its matrices; the rest: WHOLE_PARAM_OPTIMIZERS)
}
"""Per optimizer: (fp32 tensors of the shard's size, 0-dim fp32 scalars) in its state per
param group, as ``torch.optim`` creates them at the first step."""

WHOLE_PARAM_OPTIMIZERS: dict[str, str] = {"muon": "adamw"}
"""Optimizers that step whole matrices (laid out whole-params, ``flatzero.owners``), each
with the optimizer of the params it does not step: DeepSpeed's ``Muon`` config steps a param
of 2+ dims whose name holds neither ``embed`` nor ``lm_head`` with Muon, the rest with
AdamW (torch's docs pair ``torch.optim.Muon`` with AdamW for the same split)."""

PARAMS_ON = ("device", "host", "checkpoint")
"""Where the params are when init starts: on the GPU, in host memory, or on the meta
device with their values in a safetensors checkpoint."""

GROUPINGS = ("one", "decay")
"""How params are grouped: ``one`` group, or ``decay`` (params with 2+ dims) and the rest,
as trainers do for weight decay."""

DEFAULT_FILL_BYTES = DEFAULT_BUCKET_NUMEL * 2
"""One default bucket of bf16 params (bytes): the size flatzero's fill writes at a time."""
