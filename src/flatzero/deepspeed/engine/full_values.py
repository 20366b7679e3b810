"""A param's full fp32 value, gradient or optimizer state, read from and written to the shards.

What DeepSpeed's ``deepspeed.utils.safe_get_full_fp32_param`` (and its five siblings) do on
its ZeRO-1/2 optimizer, done on a ``ZeroOptimizer``: every rank holds the pieces of a param
that lie in its shard (``GroupLayout.param_pieces``); a getter copies this rank's pieces into
a zero tensor shaped like the param and sums it over the ranks (one all-reduce of the param's
size, as DeepSpeed's ``get_full_hp_param``), a setter writes this rank's pieces of the value.
Getters are collective (every rank calls them, for the same param); setters are not.

The engine registers its optimizer for its params (``register``); a param no optimizer
registered (a frozen one, or one of a model no flatzero engine trains) has no entry
(``owner`` is None), and DeepSpeed's own function then answers.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist

from ...optim import ZeroOptimizer

__all__ = [
    "GRADIENTS_GONE",
    "get_full_grad",
    "get_full_param",
    "owner",
    "register",
    "set_full_grad",
    "set_full_param",
    "unregister",
]

GRADIENTS_GONE = "Gradients are only available immediately after backward and before engine step"
"""DeepSpeed's message for a gradient asked for outside that window."""

_OWNERS: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[ZeroOptimizer]]] = {}
"""``id(param) -> (param, the optimizer that trains it)``, both weakly (bookkeeping kept here,
never on the user's param; keyed by id: tensors compare elementwise, so a weak-key mapping
would compare values)."""


def register(optimizer: ZeroOptimizer) -> None:
    """Make ``optimizer`` the owner of every param it flattened."""
    ref = weakref.ref(optimizer)
    for key in [k for k, (p, o) in _OWNERS.items() if p() is None or o() is None]:
        del _OWNERS[key]  # entries of params or optimizers gone since
    for group in optimizer.flat.groups:
        for param in group.params:
            _OWNERS[id(param)] = (weakref.ref(param), ref)


def unregister(optimizer: ZeroOptimizer) -> None:
    """Forget ``optimizer``'s params (its engine was destroyed)."""
    for group in optimizer.flat.groups:
        for param in group.params:
            entry = _OWNERS.get(id(param))
            if entry is not None and entry[1]() is optimizer:
                del _OWNERS[id(param)]


def owner(param: object) -> ZeroOptimizer | None:
    """The optimizer that trains ``param``, or None."""
    entry = _OWNERS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def _slot(optimizer: ZeroOptimizer, param: torch.Tensor) -> tuple[int, int]:
    """``(group, slot)`` of ``param`` in ``optimizer``'s layout."""
    for gi, group in enumerate(optimizer.flat.groups):
        for si, candidate in enumerate(group.params):
            if candidate is param:
                return gi, si
    raise ValueError("the param is not one of this optimizer's flattened params")


def _my_pieces(optimizer: ZeroOptimizer, gi: int, si: int) -> Iterator[tuple[int, int, int]]:
    """``(param_start, shard_start, numel)`` of the pieces of slot ``si`` in this rank's shard."""
    layout = optimizer.flat.groups[gi].layout
    for rank, piece in layout.param_pieces(si):
        if rank == optimizer.rank:
            yield piece.param_start, piece.shard_start, piece.numel


def _gather(
    optimizer: ZeroOptimizer, param: torch.Tensor, shards: list[torch.Tensor]
) -> torch.Tensor:
    """The full value of ``param`` from per-group shard-shaped tensors (fp32, param's shape,
    on the param's device). Collective."""
    gi, si = _slot(optimizer, param)
    shard = shards[gi]
    out = torch.zeros(param.numel(), dtype=torch.float32, device=shard.device)
    for param_start, shard_start, numel in _my_pieces(optimizer, gi, si):
        out[param_start : param_start + numel].copy_(shard[shard_start : shard_start + numel])
    if optimizer.world_size > 1:
        dist.all_reduce(out, group=optimizer.flat.process_group)
    return out.to(param.device).view(param.shape)


def _scatter(
    optimizer: ZeroOptimizer, param: torch.Tensor, shards: list[torch.Tensor], value: torch.Tensor
) -> None:
    """Write this rank's pieces of ``value`` (shaped like ``param``) into the shards."""
    if value.numel() != param.numel():
        raise ValueError(
            f"the value has {value.numel()} elements ({tuple(value.shape)}), the param "
            f"{param.numel()} ({tuple(param.shape)}); pass a tensor shaped like the param"
        )
    gi, si = _slot(optimizer, param)
    flat = value.detach().reshape(-1)
    shard = shards[gi]
    for param_start, shard_start, numel in _my_pieces(optimizer, gi, si):
        shard[shard_start : shard_start + numel].copy_(flat[param_start : param_start + numel])


def _state_shards(optimizer: ZeroOptimizer, key: str | None) -> list[torch.Tensor]:
    """The master shards (``key`` None) or the inner optimizer's state ``key`` per group."""
    masters = optimizer._masters  # the inner optimizer's params (its state's keys)
    if key is None:
        return [m.detach() for m in masters]
    shards = []
    for master in masters:
        value = optimizer.inner.state.get(master, {}).get(key)
        if not isinstance(value, torch.Tensor) or value.shape != master.shape:
            known = sorted(
                k
                for k, v in optimizer.inner.state.get(master, {}).items()
                if isinstance(v, torch.Tensor) and v.shape == master.shape
            )
            raise ValueError(
                f"{key!r} is not an optimizer state of {type(optimizer.inner).__name__} "
                f"(per-element states now: {known or 'none before the first step'})"
            )
        shards.append(value)
    return shards


@torch.no_grad()
def get_full_param(
    optimizer: ZeroOptimizer, param: torch.Tensor, key: str | None = None
) -> torch.Tensor:
    """The fp32 master value of ``param`` (``key`` None) or its optimizer state ``key``
    (e.g. ``"exp_avg"``), whole, in fp32. Collective."""
    return _gather(optimizer, param, _state_shards(optimizer, key))


@torch.no_grad()
def set_full_param(
    optimizer: ZeroOptimizer, param: torch.Tensor, value: torch.Tensor, key: str | None = None
) -> None:
    """Write the whole fp32 master value (``key`` None) or optimizer state ``key`` of
    ``param``; the param itself takes the master value at the next step, as in DeepSpeed."""
    _scatter(optimizer, param, _state_shards(optimizer, key), value)


def _reduced_grads(optimizer: ZeroOptimizer) -> list[torch.Tensor]:
    if not optimizer._reducer.backward_seen:
        raise ValueError(GRADIENTS_GONE)
    optimizer.reduce_gradients()
    return optimizer.grad_shards


@torch.no_grad()
def get_full_grad(optimizer: ZeroOptimizer, param: torch.Tensor) -> torch.Tensor:
    """The gradient of ``param`` as DeepSpeed's ZeRO-1/2 holds it between backward and step:
    averaged over the ranks, summed over the window's micro-batches (each loss divided by
    ``gradient_accumulation_steps``), times the fp16 loss scale; fp32. Reduces the window's
    gradients first (``reduce_gradients``). Collective."""
    grad = _gather(optimizer, param, _reduced_grads(optimizer))
    return grad / optimizer.world_size


@torch.no_grad()
def set_full_grad(optimizer: ZeroOptimizer, param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace the gradient of ``param`` (as ``get_full_grad`` returns it) before the step;
    an inf/nan written here makes the step skip where overflow is checked (fp16, bf16).
    Collective (the window's gradients are reduced first)."""
    shards = _reduced_grads(optimizer)
    scaled = value.detach().to(torch.float32) * optimizer.world_size
    _scatter(optimizer, param, shards, scaled)
    optimizer._norm_cache = None  # a norm computed before the write is stale
    optimizer._stepper.abandon()  # offload: copy every shard to the host again at the step
