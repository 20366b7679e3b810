"""Before ``ZeroOptimizer`` holds anything: the user's params -> checked ``FlatParams``,
and the fp32 gradient shards beside the master shards.

Order: collect the param groups (``params.collect_param_groups``, the one place params are
normalized) -> check the optimizer's arguments on dummies and that no other optimizer
hooks the params -> every rank agrees on the setup -> flatten (layout, tier, buckets,
master shards) -> check the buckets suit the collectives -> allocate the gradient shards
-> the reducer of the stage (``make_reducer``). Nothing is flattened before every check
passed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import check_same_everywhere, world_size_of
from ..config import FlattenConfig
from ..control import every_rank_or_none
from ..devices import backend_of, collectives_run_on
from ..flatten import FlatParams, flatten_parameters
from ..flatten.alloc import allocate_agreed
from ..layout import GroupLayout
from ..own_groups import control_group
from ..params import ParamGroup, collect_param_groups
from .buckets import empty_buffer
from .config import ZeroConfig
from .inner import (
    build_inner_optimizer,
    check_optimizer_class,
    needs_whole_params,
    whole_groups,
)
from .offload import check_host_kernel
from .reducers import GradReducer, check_unclaimed
from .stage1 import Stage1Reducer
from .stage2 import LocalStage2Reducer, Stage2Reducer
from .whole import WholePiece

__all__ = [
    "allocate_grad_shards",
    "check_buckets_usable",
    "flat_params_for",
    "make_reducer",
    "whole_pieces",
    "whole_setting",
]


def _probe_optimizer(
    optimizer: Callable[..., torch.optim.Optimizer],
    options: list[dict[str, Any]],
    defaults: dict[str, Any],
) -> None:
    """Build the optimizer on dummies so bad arguments fail before anything is flattened."""
    dummies = [nn.Parameter(torch.zeros(1)) for _ in options]
    build_inner_optimizer(optimizer, dummies, options, defaults)


_REFUSED_ELSEWHERE = (
    "ZeroOptimizer's arguments (optimizer, its options, params or groups) were refused on "
    "another rank (see its error); nothing was flattened"
)


def _check_given_flat(
    flat: FlatParams, process_group: dist.ProcessGroup | None, whole: Sequence[bool]
) -> None:
    """Refuse ``FlatParams`` over another process group, without master shards, or with
    params cut between ranks in a group that ``whole`` (per flat group) says the optimizer
    steps whole."""
    if not all(
        len(g.param_pieces(i)) <= 1
        for g, is_whole in zip(flat.layout.groups, whole, strict=True)
        if is_whole
        for i in range(len(g.slots))
    ):
        raise ValueError(
            "the optimizer steps whole params but the FlatParams cut some params between "
            "ranks; flatten with FlattenConfig(whole_params=True) (or the indices of the "
            "groups it steps whole)"
        )
    if process_group is not None and process_group is not flat.process_group:
        raise ValueError(
            "process_group differs from the one the FlatParams were flattened over; "
            "drop the process_group argument"
        )
    if any(g.master is None for g in flat.groups):
        raise ValueError(
            "the FlatParams have no fp32 master shards (FlattenConfig.build_master="
            "False); flatten with build_master=True"
        )


def _as_group_dicts(groups: list[ParamGroup]) -> list[dict[str, Any]]:
    """Collected groups in ``torch.optim``'s form, trainable params named as collected."""
    return [{**g.options, "params": list(zip(g.names, g.params, strict=True))} for g in groups]


def _leave_params_in_place(groups: list[ParamGroup]) -> FlattenConfig:
    """Like ``torch.optim``, flatten on the device the trainable params are on."""
    device = next(p.device for g in groups for p in g.params)
    return FlattenConfig(device=str(device) if device.type != "meta" else None)


def _probe(
    optimizer: Callable[..., torch.optim.Optimizer],
    options: list[dict[str, Any]],
    defaults: dict[str, Any],
    offload: bool,
) -> None:
    """Bad optimizer arguments, and (with optimizer offload) an optimizer that cannot step
    host tensors, fail here, before anything is flattened."""
    _probe_optimizer(optimizer, options, defaults)
    if offload:
        cls = check_optimizer_class(optimizer, elementwise=True)
        if hasattr(cls, "grads_to_updates"):  # [Note: updates before the norm]
            raise TypeError(
                f"{cls.__name__} turns gradients into updates before the norm, on the "
                "gradient shards beside the buckets; with optimizer offload the optimizer "
                "steps host copies of them: turn optimizer offload off"
            )
        check_host_kernel(optimizer, options, defaults)


def flat_params_for(
    params: Any,
    optimizer: Callable[..., torch.optim.Optimizer],
    defaults: dict[str, Any],
    setup: dict[str, str],
    *,
    process_group: dist.ProcessGroup | None,
    flatten_config: FlattenConfig | None,
    offload: bool = False,
    refused: BaseException | None = None,
) -> FlatParams:
    """The ``FlatParams`` a ``ZeroOptimizer`` runs on: ``params`` flattened, or given.

    Args:
        params: what ``ZeroOptimizer`` takes (module, params, named params, group dicts)
            or ``FlatParams`` with master shards.
        optimizer: the checked optimizer class, probed with the groups' options.
        defaults: the optimizer's keyword arguments.
        setup: what every rank must agree on (``check_same_everywhere`` fields).
        process_group: ranks to shard over.
        flatten_config: how to flatten; default: on the params' device.
        offload: optimizer offload: the optimizer must step host tensors, and the master
            shards are built in host memory (``FlattenConfig.master_on_host``).
        refused: what this rank's ``ZeroOptimizer`` refused before (its config, its
            optimizer class), raised on every rank with this function's own refusals.

    An optimizer that steps whole params (``inner.needs_whole_params``) gets a whole-params
    layout (``FlattenConfig.whole_params``); given ``FlatParams`` must have one.

    Raises:
        ValueError / TypeError: bad params, optimizer arguments or setup; nothing flattened.
            A refusal on one rank is an error on every rank, before any collective that
            rank would not join (the others: ``ValueError``, "refused on another rank").
    """
    given = isinstance(params, FlatParams)
    deciders = params.deciders if given else process_group
    catch = (ValueError, TypeError) + (() if refused is None else (type(refused),))
    with every_rank_or_none(deciders, _REFUSED_ELSEWHERE, catch=catch, error_type=ValueError):
        if refused is not None:
            raise refused
        if given:
            _probe(optimizer, [g.options for g in params.groups], defaults, offload)
            check_unclaimed(p for g in params.groups for p in g.params)
            whole = whole_groups(optimizer, [g.options for g in params.groups])
            _check_given_flat(params, process_group, whole)
        else:
            groups = collect_param_groups(params)
            _refuse_empty_groups(groups)
            _probe(optimizer, [g.options for g in groups], defaults, offload)
            check_unclaimed(p for g in groups for p in (*g.params, *g.frozen))
            whole = whole_groups(optimizer, [g.options for g in groups])
    if given:
        fields = {"layout digest": params.layout.digest(), **setup}
        check_same_everywhere("the ZeroOptimizer setup", fields, control_group(deciders))
        return params
    check_same_everywhere("the ZeroOptimizer setup", setup, control_group(process_group))
    config = flatten_config or _leave_params_in_place(groups)
    if offload:
        config = dataclasses.replace(config, master_on_host=True)
    if any(whole):
        config = dataclasses.replace(config, whole_params=whole_setting(whole))
    return flatten_parameters(_as_group_dicts(groups), process_group=process_group, config=config)


def _refuse_empty_groups(groups: list[ParamGroup]) -> None:
    """A ``ValueError`` for a param group without trainable params: ``param_groups`` holds
    one group per (param group, dtype), so it would have none and every later group's index
    would shift (a scheduler's per-group values, ``param_groups[i]["lr"] = ...`` would reach
    the wrong group)."""
    empty = [i for i, g in enumerate(groups) if not g.params]
    if empty:
        raise ValueError(
            f"param group(s) {empty} have no trainable params, so the groups after them would "
            "shift down in ZeroOptimizer.param_groups; remove the empty group(s) (or pass "
            "the optimizer to flatzero.initialize, whose client optimizer keeps its indices)"
        )


def check_buckets_usable(flat: FlatParams, *, offload: bool = False) -> None:
    """Refuse buckets the optimizer's collectives cannot run on: every bucket and master
    shard on one device (with optimizer ``offload`` the master shards go to host memory
    anyway), which the process group's backend can reduce-scatter on.

    Raises:
        ValueError: naming the devices and the backend, and what to change.
    """
    devices = {str(b.device) for g in flat.groups for b in g.buckets}
    if not offload:
        devices |= {str(g.master.device) for g in flat.groups if g.master is not None}
    if len(devices) > 1:
        raise ValueError(
            f"the flat buckets and master shards are on several devices ({sorted(devices)}); "
            "ZeroOptimizer needs them on one device. Flatten again with one tier "
            "(FlattenConfig(tier=...)) or with more free memory"
        )
    device = flat.groups[0].device
    if flat.world_size == 1:
        return
    pg = flat.process_group
    if not collectives_run_on(pg, device.type):
        raise ValueError(
            f"the flat buckets are on {device} but the process group's backend "
            f"{backend_of(pg)!r} cannot reduce-scatter {device.type} tensors; use a backend "
            f"for {device.type} tensors (nccl for cuda, gloo for cpu, or 'cpu:gloo,cuda:nccl') "
            "or flatten onto the device the backend serves (FlattenConfig(device=...))"
        )


def allocate_grad_shards(flat: FlatParams) -> list[torch.Tensor]:
    """This rank's fp32 gradient shard of every group, beside its master shard (padding
    zeroed; see ``_zero_padding``).

    Raises:
        MemoryError: on every rank, when some rank could not allocate its shards (the
            params keep their values in the buckets).
    """
    grads = allocate_agreed(
        [
            lambda g=g: empty_buffer(g.layout.shard_numel, torch.float32, g.device)
            for g in flat.groups
        ],
        flat.groups[0].device,
        control_group(flat.deciders),
        what="the fp32 gradient shards",
        nbytes=sum(g.layout.shard_numel for g in flat.groups) * 4,
        after="the params keep their values",
    )
    for grad, g in zip(grads, flat.groups, strict=True):
        _zero_padding(grad, g.layout, flat.rank)
    return grads


def _zero_padding(shard: torch.Tensor, layout: GroupLayout, rank: int) -> None:
    """Zero the padding of a gradient shard; the rest is written (not added) by the first
    reduction of every accumulation window, so it needs no zeroing: a full memset would
    touch every page of the shard once more at init, on a fresh host buffer the slowest
    part of init."""
    gaps = []
    for index, bucket in enumerate(layout.buckets):
        lo, hi = bucket.rank_range(rank)
        base = bucket.shard_offset - lo
        gaps += [shard[base + start : base + end] for start, end in layout.gaps(index, lo, hi)]
    if gaps:
        torch._foreach_zero_(gaps)


def whole_setting(whole: Sequence[bool]) -> bool | tuple[int, ...]:
    """``FlattenConfig.whole_params`` for ``whole`` (per param group, stepped whole)."""
    return True if all(whole) else tuple(i for i, w in enumerate(whole) if w)


def whole_pieces(flat: FlatParams, optimizer: Any) -> list[list[WholePiece]] | None:
    """Per group, the whole params in this rank's master shard (a whole-params layout puts
    each param inside one rank's slice; empty params are left out), for an ``optimizer``
    that ``needs_whole_params``; else None. A group it steps elementwise
    (``inner.whole_groups``) is one 1-D piece: the whole shard."""
    if not needs_whole_params(optimizer):
        return None
    whole = whole_groups(optimizer, [g.options for g in flat.groups])
    out = []
    for group, is_whole in zip(flat.layout.groups, whole, strict=True):
        if not is_whole:
            out.append([WholePiece(0, (group.shard_numel,))])
            continue
        out.append(
            [
                WholePiece(piece.shard_start, group.slots[piece.slot].spec.shape)
                for piece in group.shard_pieces(flat.rank)
                if piece.numel == group.slots[piece.slot].numel
            ]
        )
    return out


def make_reducer(flat: FlatParams, grads: list[torch.Tensor], config: ZeroConfig) -> GradReducer:
    """The reducer of ``config.stage`` (and, for stage 2, of the world size)."""
    if config.stage == 1:
        return Stage1Reducer(flat, grads, config)
    if world_size_of(flat.process_group) == 1:
        return LocalStage2Reducer(flat, grads, config)
    return Stage2Reducer(flat, grads, config)
