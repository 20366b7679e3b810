"""What helps when a rank's model states do not fit its GPU at ZeRO-1/2, with the plan's
own numbers.

[Note: what more ranks cannot do] ZeRO-1/2 keep every param whole on every rank (the flat
buckets); more ranks shrink only the fp32 master, gradient and optimizer shards. When the
params alone, or the params and what stays on the device, exceed the free memory, the
answers are to shard the params too (ZeRO-3 / FSDP: not flatzero) or to move the optimizer
to the host (optimizer offload); a smaller bucket changes only the reducer's staging slots.
Each figure below is computed from the plan's ``ModelStates`` and layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from .memory_model import offload_host_memory
from .planner import Plan

__all__ = ["FitAdvice", "fit_advice", "fit_advice_lines"]

_GIB = 2**30


@dataclass(frozen=True)
class FitAdvice:
    """Per-rank bytes of the ways out when the model states do not fit (all in bytes).

    Attributes:
        need: model states plus autograd's largest gradient, as planned.
        free: device memory free at init.
        params: the flat buckets, whole on every rank at ZeRO-1/2.
        shards: fp32 master + fp32 gradient shards + optimizer state (shrink with ranks).
        world_size: ranks in the job.
        zero3: ZeRO-3 / FSDP: ``params / world_size`` + ``shards`` + the staging slots +
            the largest gradient (the layers gathered in flight not counted).
        zero3_ranks: the fewest ranks at which ``zero3`` fits (every state sharded over
            them), or 0 when the unsharded part alone does not fit.
        zero3_offload_device: ZeRO-3 with optimizer offload, on the device:
            ``params / world_size`` + the gradient shard + staging + the largest gradient.
        offload_device: with optimizer offload, what stays on the device: ``need`` less the
            master and optimizer shards.
        offload_host: with optimizer offload, host bytes per rank (master, optimizer state
            and gradient shard: ``memory_model.offload_host_memory``).
        staging: the reducer's staging slots, the most a smaller bucket (or a smaller
            ``reduce_staging_bytes``) can save.
    """

    need: int
    free: int
    params: int
    shards: int
    world_size: int
    zero3: int
    zero3_ranks: int
    zero3_offload_device: int
    offload_device: int
    offload_host: int
    staging: int


def fit_advice(plan: Plan) -> FitAdvice | None:
    """The ways out for ``plan``, or None when its model states fit (or there is no GPU)."""
    spec = plan.spec
    s = plan.states
    need = s.total + plan.largest_gradient
    if spec.gpu is None or need <= plan.free_bytes:
        return None
    shards = s.master + s.grad_shards + s.optimizer
    if plan.offload_host is not None:  # already offloaded: the host keeps master and state
        host = plan.offload_host.total
    else:
        host = offload_host_memory(
            plan.layout, optimizer=spec.optimizer, pinned=spec.pin_memory
        ).total
    fixed = s.grad_staging + plan.largest_gradient  # not sharded
    sharded_total = s.params + shards * spec.world_size  # every rank's states, summed
    room = plan.free_bytes - fixed
    params_share = -(-s.params // spec.world_size)
    return FitAdvice(
        need=need,
        free=plan.free_bytes,
        params=s.params,
        shards=shards,
        world_size=spec.world_size,
        zero3=params_share + shards + fixed,
        zero3_ranks=-(-sharded_total // room) if room > 0 else 0,
        zero3_offload_device=params_share + s.grad_shards + fixed,
        offload_device=need - s.master - s.optimizer,
        offload_host=host,
        staging=s.grad_staging,
    )


def _gib(nbytes: int) -> str:
    return f"{nbytes / _GIB:.2f} GiB"


def _fits(nbytes: int, free: int) -> str:
    return "fits" if nbytes <= free else "does NOT fit"


def fit_advice_lines(plan: Plan) -> list[str]:
    """``fit_advice`` as lines for the report (none when the states fit)."""
    a = fit_advice(plan)
    if a is None:
        return []
    ranks_per_node = plan.spec.gpus_per_node
    more_ranks = (
        "more ranks cannot make it fit (the params alone exceed the free memory)"
        if a.params > a.free
        else f"more ranks shrink only the shards: at most {_gib(a.shards)} to gain"
    )
    offloaded = plan.offload_host is not None
    zero3_ranks = f", from {a.zero3_ranks} ranks on" if a.zero3 > a.free and a.zero3_ranks else ""
    offload = (
        f"  - optimizer offload ({'on' if offloaded else '--offload-optimizer cpu'}): "
        f"{_gib(a.offload_device)} stays on the device ({_fits(a.offload_device, a.free)}); "
        f"the host needs {_gib(a.offload_host)} per rank, {ranks_per_node} x = "
        f"{_gib(ranks_per_node * a.offload_host)} per node"
    )
    return [
        f"does not fit: {_gib(a.need)} needed per rank, {_gib(a.free)} free. At ZeRO-1/2 "
        f"every rank holds the whole params ({_gib(a.params)}); the fp32 shards are "
        f"{_gib(a.shards)} at {a.world_size} ranks, so {more_ranks}. What helps:",
        f"  - ZeRO-3 / FSDP (params sharded too; DeepSpeed stage 3 or torch FSDP, not "
        f"flatzero): about {_gib(a.zero3)} per rank (params / {a.world_size} + the same "
        f"shards; the layers gathered in flight not counted): {_fits(a.zero3, a.free)}"
        f"{zero3_ranks}; with optimizer offload too, {_gib(a.zero3_offload_device)} on the "
        f"device ({_fits(a.zero3_offload_device, a.free)})",
        offload,
        f"  - a smaller bucket (--bucket-numel) or reduce_staging_bytes: saves at most the "
        f"staging slots, {_gib(a.staging)} ({_fits(a.need - a.staging, a.free)} without them)",
    ]
