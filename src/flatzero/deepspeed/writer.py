"""DeepSpeed 0.19's ZeRO-1/2 checkpoint files from a flatzero checkpoint, tensor by tensor.

See the note beside the file names.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.format import MASTER, decode_value
from ..checkpoint.reader import CheckpointReader
from ..dtypes import SAFETENSORS_DTYPES
from ..layout import Layout, ParamSpec
from ..storage.tensorfile import open_safetensors
from . import pickle as ds_pickle
from .base_optimizer import FUSED_ADAM, kernel_group, kernel_scalar
from .layout import (
    alignment_paddings,
    deepspeed_layout,
    group_padding,
    round_robin_order,
)
from .muon_state import MOMENTUM, is_muon_group, momentum_pieces, muon_order
from .pickle import FragmentAddress, StoredTensor, TorchZipWriter, ZeroStage
from .state import deepspeed_loss_scaler
from .target import DeepSpeedTarget

__all__ = [
    "DEEPSPEED_VERSION",
    "DeepSpeedPlan",
    "plan_deepspeed",
    "write_model_states",
    "write_optim_states",
]

# [Note: the two kinds of files, and how a partition is filled.
# Two kinds of files, each in ``torch.save``'s format (``pickle.TorchZipWriter``), with
# DeepSpeed's own classes pickled by name (``pickle.pickler``), holding what DeepSpeed's engine
# and its ``DeepSpeedZeroOptimizer.state_dict()`` hold:
#
# - ``mp_rank_00_model_states.pt``: ``module`` (the model's state dict in the training
#   dtype: trained params cast from the fp32 masters, frozen params and buffers as saved, a
#   tied weight under each of its names), ``buffer_names``, ``param_shapes`` (per group, in
#   flat order), ``frozen_param_shapes`` / ``frozen_param_fragments`` (stage 2),
#   ``shared_params``, ``lr_scheduler``, the step counters, ``dp_world_size``,
#   ``mp_world_size``, ``ds_config``, ``ds_version``, then the client state's keys.
# - ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank: ``optimizer_state_dict``
#   with ``loss_scaler``, ``dynamic_loss_scale``, ``overflow``, ``clip_grad``,
#   ``base_optimizer_state`` (the base optimizer's ``state_dict()`` over one flat fp32
#   partition per group: per-element states of the partition's length, padding zero; in the
#   format of the class DeepSpeed builds for the run, ``base_optimizer``),
#   ``single_partition_of_fp32_groups`` (the rank's master partitions without their
#   trailing padding), ``zero_stage``, ``group_paddings``, ``param_alignment_paddings``,
#   ``partition_count``, ``ds_version``, ``param_slice_mappings``; and ``ds_config``,
#   ``ds_version``.
#
# A partition is filled through the resharding plans of a flatzero load
# (``CheckpointReader.plan`` / ``read`` against DeepSpeed's layout, ``deepspeed_layout``),
# one partition of one state at a time; the module's params one at a time. Memory: one
# partition (fp32) or the largest param, whichever is larger.
#
# flatzero's checkpoint does not say which of the model's other tensors are frozen params
# and which are buffers: every one is listed in ``buffer_names`` and, at stage 2, every
# floating-point one in ``frozen_param_shapes``/``frozen_param_fragments`` (DeepSpeed's load
# looks up its frozen params there and ignores the rest).]
DEEPSPEED_VERSION = "0.19.8"
"""The DeepSpeed version whose format is written (``ds_version``)."""


@dataclass(frozen=True)
class DeepSpeedPlan:
    """A flatzero checkpoint laid out as DeepSpeed's.

    Attributes:
        target: the DeepSpeed run written for.
        layout: DeepSpeed's flat partitions; group ``i``'s params in flat order, named as
            in the model.
        order: per group, the model names of its params in the group's own order
            (DeepSpeed's ``bit16_groups``; the flat order differs with round robin).
        paddings: per group, the zeros after each param in flat order.
        rename: model name -> name in the flatzero checkpoint, where they differ.
        empty: trained params without elements (DeepSpeed keeps them out of its groups).
    """

    target: DeepSpeedTarget
    layout: Layout
    order: tuple[tuple[str, ...], ...]
    paddings: tuple[tuple[int, ...], ...]
    rename: Mapping[str, str]
    empty: tuple[str, ...]


def plan_deepspeed(reader: CheckpointReader, target: DeepSpeedTarget) -> DeepSpeedPlan:
    """DeepSpeed's layout of the checkpoint's params for ``target``."""
    meta = reader.meta
    names = meta.model_names
    groups, order, paddings, empty = [], [], [], []
    for group in meta.layout.groups:
        slots = sorted(group.slots, key=lambda s: s.registration_index)
        specs = [
            ParamSpec(names.get(s.spec.name, s.spec.name), s.spec.shape, s.spec.dtype)
            for s in slots
        ]
        empty += [s.name for s in specs if s.numel == 0]
        specs = [s for s in specs if s.numel > 0]
        if _muon_group(meta.groups[group.group_index].hyperparams, target):
            specs = muon_order(specs)  # MuonWithAuxAdam sorts them before ZeRO flattens
        order.append(tuple(s.name for s in specs))
        if target.round_robin:
            specs = [specs[i] for i in round_robin_order(len(specs), target.world_size)]
        pads = (
            alignment_paddings(specs, target.dtype.itemsize)
            if target.parameter_alignment
            else [0] * len(specs)
        )
        groups.append(specs)
        paddings.append(tuple(pads))
    return DeepSpeedPlan(
        target=target,
        layout=deepspeed_layout(groups, target.world_size, paddings),
        order=tuple(order),
        paddings=tuple(paddings),
        rename={model: saved for saved, model in names.items()},
        empty=tuple(empty),
    )


def _muon_group(hyperparams: Mapping[str, Any], target: DeepSpeedTarget) -> bool:
    """Whether a group (its recorded hyperparameters) is written as a Muon group of
    DeepSpeed's (``muon_state``): ``use_muon``, for a run of DeepSpeed's Muon or of the
    optimizer the checkpoint holds (an imported one)."""
    hyper = {k: decode_value(v) for k, v in hyperparams.items()}
    return is_muon_group(hyper) and (target.optimizer is None or target.optimizer.muon)


class _Pending:
    """The tensors of one file: placeholders in its object, their data produced on
    demand when the file is written (one at a time)."""

    def __init__(self) -> None:
        self.items: list[tuple[StoredTensor, Callable[[], torch.Tensor]]] = []

    def add(
        self, dtype: torch.dtype, shape: tuple[int, ...], produce: Callable[[], torch.Tensor]
    ) -> StoredTensor:
        stored = StoredTensor(str(len(self.items)), dtype, tuple(shape))
        self.items.append((stored, produce))
        return stored

    def write(self, path: Path, obj: Any) -> None:
        """Write ``obj`` with every pending tensor to ``path`` and fsync it."""
        stored_tensors = [s for s, _ in self.items]
        with open(path, "wb") as f:
            with TorchZipWriter(f, obj, stored_tensors, pickler=ds_pickle.pickler) as writer:
                for stored, produce in self.items:
                    # produced inline: no earlier tensor is alive while the next is produced
                    tensor = produce().to(stored.dtype).reshape(stored.shape).contiguous()
                    writer.write(stored, tensor)
                writer.finish()
            f.flush()
            os.fsync(f.fileno())


# ---------------------------------------------------------------------- model states
def _module(
    reader: CheckpointReader, plan: DeepSpeedPlan, pending: _Pending
) -> tuple[dict[str, StoredTensor], list[str]]:
    """The module's state dict as placeholders; the names of the tensors outside the
    optimizer groups (frozen params and buffers)."""
    dtype = plan.target.dtype
    module: dict[str, StoredTensor] = OrderedDict()
    shapes = {s.spec.name: s.spec.shape for g in plan.layout.groups for s in g.slots}
    for names in plan.order:
        for name in names:
            saved = plan.rename.get(name, name)
            module[name] = pending.add(
                dtype, shapes[name], lambda saved=saved: reader.read_param(saved, MASTER)
            )
    outside = list(plan.empty)
    specs = {s.spec.name: s.spec for g in reader.meta.layout.groups for s in g.slots}
    for name in plan.empty:
        spec = specs[plan.rename.get(name, name)]
        module[name] = pending.add(dtype, spec.shape, lambda s=spec: torch.zeros(s.shape))
    if reader.meta.model_rest is not None:
        handle = open_safetensors(reader.path / reader.meta.model_rest)
        for key in list(handle.keys()):
            piece = handle.get_slice(key)
            module[key] = pending.add(
                SAFETENSORS_DTYPES[piece.get_dtype()],
                tuple(piece.get_shape()),
                lambda key=key: handle.get_tensor(key),
            )
            outside.append(key)
    for alias, target in reader.meta.aliases.items():
        if target in module:
            module[alias] = module[target]
    return module, outside


def write_model_states(
    path: Path,
    reader: CheckpointReader,
    plan: DeepSpeedPlan,
    *,
    counters: Mapping[str, int | None],
    scheduler: Any,
    client_state: Mapping[str, Any],
) -> None:
    """Write ``mp_rank_00_model_states.pt``.

    Args:
        path: the file.
        reader: the flatzero checkpoint.
        plan: its DeepSpeed layout.
        counters: ``global_steps``, ``global_samples`` (None: left out, DeepSpeed derives
            it), ``skipped_steps``.
        scheduler: the ``lr_scheduler`` entry.
        client_state: the client state (its keys go beside DeepSpeed's).
    """
    target = plan.target
    pending = _Pending()
    module, outside = _module(reader, plan, pending)
    frozen = [n for n in outside if module[n].dtype.is_floating_point]
    stage2 = target.stage == 2
    state: dict[str, Any] = {
        "module": module,
        "buffer_names": list(outside),
        "optimizer": None,
        "param_shapes": [
            OrderedDict((s.spec.name, torch.Size(s.spec.shape)) for s in g.slots)
            for g in plan.layout.groups
        ],
        "frozen_param_shapes": (
            OrderedDict((n, torch.Size(module[n].shape)) for n in frozen) if stage2 else None
        ),
        "shared_params": dict(reader.meta.aliases),
        "frozen_param_fragments": OrderedDict((n, module[n]) for n in frozen) if stage2 else None,
        "lr_scheduler": scheduler,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": int(counters["skipped_steps"] or 0),
        "global_steps": int(counters["global_steps"] or 0),
    }
    if counters.get("global_samples") is not None:
        state["global_samples"] = int(counters["global_samples"])
    state |= {
        "dp_world_size": target.world_size,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": dict(target.config),
        "ds_version": DEEPSPEED_VERSION,
    }
    clash = sorted(set(client_state) & set(state))
    if clash:
        raise ValueError(
            f"the checkpoint's client state has keys {clash} that DeepSpeed keeps for itself "
            "in mp_rank_00_model_states.pt; rename them"
        )
    pending.write(path, {**state, **client_state})


# ---------------------------------------------------------------------- optim states
def _read_partition(
    reader: CheckpointReader, read_plan: Any, state: str, dtype: torch.dtype
) -> Callable[[], torch.Tensor]:
    def produce() -> torch.Tensor:
        out = torch.zeros(read_plan.shard_numel, dtype=dtype)
        return reader.read(read_plan, state, out)

    return produce


def _momentum(
    reader: CheckpointReader, plan: DeepSpeedPlan, gi: int, rank: int, pending: _Pending
) -> StoredTensor:
    """Rank ``rank``'s ``momentum_buffer`` of Muon group ``gi`` as DeepSpeed keeps it: the
    whole momentum of every param in its partition, concatenated in flat order."""
    group = plan.layout.groups[gi]
    names = [group.slots[p.slot].spec.name for p in momentum_pieces(group, rank)]
    numel = sum(group.slots[p.slot].numel for p in momentum_pieces(group, rank))

    def produce() -> torch.Tensor:
        parts = [reader.read_param(plan.rename.get(n, n), MOMENTUM).reshape(-1) for n in names]
        return torch.cat(parts) if parts else torch.zeros(0)

    return pending.add(torch.float32, (numel,), produce)


def _base_state(
    reader: CheckpointReader,
    read_plans: list[Any],
    pending: _Pending,
    plan: DeepSpeedPlan,
    rank: int,
) -> dict[str, Any]:
    """The base optimizer's ``state_dict()`` over the rank's flat partitions: torch's, or
    (the run's optimizer one of DeepSpeed's Adam kernels) in that class's format, or
    (DeepSpeed's Muon) Muon groups as ``muon_state`` says and the others FusedAdam's."""
    optimizer = plan.target.optimizer
    kernel = optimizer.name if optimizer is not None and optimizer.kernel else None
    if optimizer is not None and optimizer.muon:
        kernel = FUSED_ADAM
    state: dict[int, dict[str, Any]] = {}
    groups = []
    for gi, (record, read_plan) in enumerate(zip(reader.meta.groups, read_plans, strict=True)):
        entry: dict[str, Any] = {}
        if _muon_group(record.hyperparams, plan.target):
            entry[MOMENTUM] = _momentum(reader, plan, gi, rank, pending)
            groups.append({**_hyper(record), "params": [gi]})
            state[gi] = entry
            continue
        for name, value in record.scalars.items():
            scalar = decode_value(value)
            if kernel:
                scalar = kernel_scalar(name, scalar)
            if isinstance(scalar, torch.Tensor):
                scalar = pending.add(scalar.dtype, tuple(scalar.shape), lambda v=scalar: v)
            entry[name] = scalar
        for name in record.states[1:]:
            dtype = reader.state_dtype(gi, name)
            entry[name] = pending.add(
                dtype, (read_plan.shard_numel,), _read_partition(reader, read_plan, name, dtype)
            )
        if entry:
            state[gi] = entry
        hyper = _hyper(record)
        if kernel:
            hyper = kernel_group(hyper, kernel)
        groups.append({**hyper, "params": [gi]})
    return {"state": state, "param_groups": groups}


def _hyper(record: Any) -> dict[str, Any]:
    """A group record's hyperparameters, decoded."""
    return {k: decode_value(v) for k, v in record.hyperparams.items()}


def _slice_mappings(plan: DeepSpeedPlan, rank: int) -> list[OrderedDict[str, FragmentAddress]]:
    """Per group, where each param's fragment lies in ``rank``'s partition (in the group's
    own order, as DeepSpeed lists them)."""
    out = []
    for group, names in zip(plan.layout.groups, plan.order, strict=True):
        pieces = {group.slots[p.slot].spec.name: p for p in group.shard_pieces(rank)}
        out.append(
            OrderedDict(
                (n, FragmentAddress(numel=pieces[n].numel, start=pieces[n].shard_start))
                for n in names
                if n in pieces
            )
        )
    return out


def write_optim_states(
    path: Path,
    reader: CheckpointReader,
    plan: DeepSpeedPlan,
    rank: int,
    *,
    loss_scaler: Mapping[str, Any] | None,
    steps: int,
) -> None:
    """Write rank ``rank``'s optimizer-state file.

    Args:
        path: the file.
        reader: the flatzero checkpoint.
        plan: its DeepSpeed layout.
        rank: the DeepSpeed rank.
        loss_scaler: flatzero's loss-scaler state (None without one).
        steps: optimizer steps taken, skipped ones included.
    """
    target = plan.target
    pending = _Pending()
    read_plans = reader.plan(plan.layout, rank, rename=plan.rename, strict=False)
    scaler = deepspeed_loss_scaler(loss_scaler, target.fp16, steps)
    paddings = [group_padding(g, rank) for g in plan.layout.groups]
    base = _base_state(reader, read_plans, pending, plan, rank)
    masters = []
    for read_plan, pad in zip(read_plans, paddings, strict=True):
        full = _read_partition(reader, read_plan, MASTER, torch.float32)
        lean = read_plan.shard_numel - pad
        masters.append(pending.add(torch.float32, (lean,), lambda f=full, n=lean: f()[:n]))
    optimizer: dict[str, Any] = {
        "loss_scaler": scaler,
        "dynamic_loss_scale": bool(scaler.dynamic),
        "overflow": False,
    }
    if target.clip_grad is not None:
        optimizer["clip_grad"] = target.clip_grad
    stage = ZeroStage.gradients if target.stage == 2 else ZeroStage.optimizer_states
    optimizer |= {
        "base_optimizer_state": base,
        "single_partition_of_fp32_groups": masters,
        "zero_stage": stage,
        "group_paddings": paddings,
        "param_alignment_paddings": [list(p) for p in plan.paddings],
        "partition_count": [target.world_size] * len(plan.layout.groups),
        "ds_version": DEEPSPEED_VERSION,
        "param_slice_mappings": _slice_mappings(plan, rank),
    }
    obj = {
        "optimizer_state_dict": optimizer,
        "ds_config": dict(target.config),
        "ds_version": DEEPSPEED_VERSION,
    }
    pending.write(path, obj)
