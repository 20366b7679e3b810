"""``make_plan``: memory, tier, bytes per link and init time of one job, from its shape.

The model is built on the meta device and laid out with the library's own
``plan_layout``; the memory, traffic, decision and time models of this package read that
layout. Nothing is allocated and no process group is needed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..config import DEFAULT_BUCKET_NUMEL
from ..deepspeed.layout import padded_numel
from ..flatten.choice import TierDecision, decide_tier
from ..flatten.registry import canonical_tier
from ..layout import DEFAULT_ALIGNMENT, Layout, plan_layout
from ..optim.offload import OffloadHostBytes
from .calibration import Calibration
from .decision import deepspeed_path, free_at_init
from .hardware import GpuSpec, HostSpec, get_host
from .memory_model import (
    InitMemory,
    ModelStates,
    async_snapshot_bytes,
    deepspeed_init_memory,
    flatzero_init_memory,
    held_gradient_bytes,
    itemsize,
    model_states,
    offload_host_memory,
)
from .model_source import ModelSource, param_groups
from .muon import MuonBalance, muon_balance, muon_param_groups
from .names import GROUPINGS, PARAMS_ON, WHOLE_PARAM_OPTIMIZERS
from .rates import Rates, node_rates
from .time_model import (
    InitTime,
    StepComm,
    Work,
    deepspeed_time,
    flatzero_time,
    placement_time,
    step_comm,
)
from .traffic import KINDS, deepspeed_bytes, deepspeed_master_bytes, flatzero_bytes, links

__all__ = [
    "PARAMS_ON",
    "MethodPlan",
    "Plan",
    "PlanSpec",
    "huge_pages_advice",
    "make_plan",
    "new_memory_sizes",
    "tiers_for",
]

_SAMPLED_RANKS = 64
"""Above this world size the per-rank bytes are computed for the first, middle and last
rank only (the ``sharded`` tier's host bytes differ slightly between ranks)."""


@dataclass(frozen=True)
class PlanSpec:
    """One job to plan.

    Attributes:
        model: the model.
        nodes: nodes in the job.
        gpus_per_node: ranks per node (one per GPU; the host's cores on a CPU-only job).
        gpu: the accelerator, or None for a job on CPUs (tier ``cpu``).
        host: the host of each node.
        dtype: the params' dtype (``"bfloat16"``, ``"float16"``, ``"float32"``).
        stage: ZeRO stage, 1 or 2.
        optimizer: a key of ``memory_model.OPTIMIZER_STATES``; ``muon`` splits every group
            into a Muon half laid out whole-params and an AdamW half (``plan.muon``).
        bucket_numel: bucket size in elements (``FlattenConfig.bucket_numel``).
        alignment: param alignment in elements (``FlattenConfig.alignment``).
        params_on: one of ``PARAMS_ON``.
        grouping: one of ``model_source.GROUPINGS``.
        tier: the requested tier (``"auto"`` or a tier name).
        host_ram_bytes: host RAM per node (bytes); None: the host spec's.
        reserved_bytes: device memory per rank that is not free at init (CUDA context,
            NCCL buffers, fragmentation), bytes.
        staging_buffers: ``FlattenConfig.staging_buffers`` and ``ZeroConfig.staging_buffers``.
        reduce_dtype: ``ZeroConfig.reduce_dtype``.
        grad_accum: micro-batches per optimizer step.
        calibration: measured rates of a machine, replacing the host's figures.
        host_huge_pages: ``FlattenConfig.host_huge_pages``: flatzero's host buffers on
            2 MiB pages (their own new-memory rates) or from torch's allocator.
        offload_optimizer: optimizer offload (DeepSpeed's ``offload_optimizer: {device:
            cpu}``): master shards, optimizer state and a gradient shard in host memory.
        pin_memory: with ``offload_optimizer``, the host gradient shards page-locked
            (``offload_optimizer.pin_memory``; nothing is pinned without a GPU).
        async_save: checkpoints are saved asynchronously (``save_checkpoint(...,
            asynchronous=True)``, the door's ``"flatzero": {"async_save": true}``): every rank
            keeps a host copy of what it writes (``Plan.async_snapshot``).
    """

    model: ModelSource
    nodes: int = 1
    gpus_per_node: int = 8
    gpu: GpuSpec | None = None
    host: HostSpec = field(default_factory=lambda: get_host("dgx-h100"))
    dtype: str = "bfloat16"
    stage: int = 2
    optimizer: str = "adamw"
    bucket_numel: int = DEFAULT_BUCKET_NUMEL
    alignment: int = DEFAULT_ALIGNMENT
    params_on: str = "host"
    grouping: str = "one"
    tier: str = "auto"
    host_ram_bytes: int | None = None
    reserved_bytes: int = 2**30
    staging_buffers: int = 2
    reduce_dtype: str = "float32"
    grad_accum: int = 1
    calibration: Calibration | None = None
    host_huge_pages: bool = True
    offload_optimizer: bool = False
    pin_memory: bool = True
    async_save: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "tier", canonical_tier(self.tier))  # "offload": "host_park"
        for name in (
            "nodes",
            "gpus_per_node",
            "bucket_numel",
            "alignment",
            "staging_buffers",
            "grad_accum",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PlanSpec.{name} must be a positive int, got {value!r}")
        if self.stage not in (1, 2):
            raise ValueError(f"PlanSpec.stage must be 1 or 2, got {self.stage!r}")
        if self.params_on not in PARAMS_ON:
            raise ValueError(
                f"PlanSpec.params_on must be one of {PARAMS_ON}, got {self.params_on!r}"
            )
        if self.grouping not in GROUPINGS:
            raise ValueError(f"PlanSpec.grouping must be one of {GROUPINGS}, got {self.grouping!r}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"PlanSpec.dtype {self.dtype!r}: use bfloat16, float16 or float32")
        if self.gpu is None and self.params_on == "device":
            raise ValueError("PlanSpec.params_on='device' needs a GPU; use 'host' on CPUs")
        if self.reserved_bytes < 0:
            raise ValueError(f"PlanSpec.reserved_bytes must be >= 0, got {self.reserved_bytes}")

    @property
    def world_size(self) -> int:
        """Ranks in the job."""
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class MethodPlan:
    """One init method (a flatzero tier or a DeepSpeed path) for one rank.

    Attributes:
        method: the tier or path.
        bytes_moved: bytes by ``InitReport.bytes_moved`` kind (the largest over ranks).
        links: the same by link (``hbm``, ``host_memory``, ``pcie_h2d``, ``pcie_d2h``,
            ``intra_node``, ``network``).
        memory: peak memory during init.
        time: predicted seconds.
        note: what else to know (e.g. the path DeepSpeed 0.19 takes).
    """

    method: str
    bytes_moved: dict[str, int]
    links: dict[str, int]
    memory: InitMemory
    time: InitTime
    note: str = ""


@dataclass(frozen=True)
class Plan:
    """Everything ``flatzero plan`` reports for one ``PlanSpec``.

    Attributes:
        spec: the job.
        layout: the model's layout at the job's world size.
        states: per-rank model states after the first step.
        decision: the tier ``auto`` takes (or None when nothing fits) and why.
        free_bytes: free device memory per rank when init starts.
        methods: flatzero's applicable tiers, then DeepSpeed's paths, by name.
        deepspeed_019: the path DeepSpeed 0.19.x takes, and why.
        placement_seconds: DeepSpeed's ``module.to(device)`` first (0 unless params are in
            host memory).
        step: per-step communication.
        rates: the rates the times were computed with.
        host_ram_bytes: host RAM per node the plan checks against.
        offload_host: with ``spec.offload_optimizer``, the host bytes of optimizer offload
            per rank (``memory_model.offload_host_memory``); else None. ``states`` then
            holds no master shard nor optimizer state where a GPU holds the rest.
        async_snapshot: host bytes per rank an asynchronous save keeps
            (``memory_model.async_snapshot_bytes``), whether ``spec.async_save`` or not.
        largest_gradient: bytes of autograd's gradients backward holds at once beside
            ``states``, at least: the largest param's, and in stage 2 over several ranks the
            largest bucket's (``memory_model.held_gradient_bytes``).
        muon: with an optimizer that steps whole matrices (``--optimizer muon``), how their
            owners share the work (``muon.muon_balance``); else None.
    """

    spec: PlanSpec
    layout: Layout
    states: ModelStates
    decision: TierDecision
    free_bytes: int
    methods: dict[str, MethodPlan]
    deepspeed_019: tuple[str, str]
    placement_seconds: float
    step: StepComm
    rates: Rates
    host_ram_bytes: int
    offload_host: OffloadHostBytes | None = None
    async_snapshot: int = 0
    largest_gradient: int = 0
    muon: MuonBalance | None = None


def tiers_for(spec: PlanSpec) -> tuple[str, ...]:
    """flatzero's tiers that can run this job, given where the params start."""
    if spec.gpu is None:
        return ("cpu",)
    return ("device", "host_park") if spec.params_on == "device" else ("host", "sharded")


def _work(layout: Layout) -> Work:
    return Work(
        tensors=layout.num_params,
        param_bytes=sum(g.param_numel * itemsize(g.dtype) for g in layout.groups),
        bucket_bytes=sum(g.numel * itemsize(g.dtype) for g in layout.groups),
        slice_bytes=sum(g.shard_numel * itemsize(g.dtype) for g in layout.groups),
        master_bytes=sum(g.shard_numel for g in layout.groups) * 4,
        master_cast_bytes=sum(g.shard_numel for g in layout.groups if g.dtype != "float32") * 4,
    )


def _max_over_ranks(layout: Layout, tier: str, spec: PlanSpec, build_master: bool) -> dict:
    ws = layout.world_size
    ranks = range(ws) if ws <= _SAMPLED_RANKS else (0, ws // 2, ws - 1)
    buffers = "cpu" if spec.gpu is None else "cuda"
    out = dict.fromkeys(KINDS, 0)
    for rank in ranks:
        moved = flatzero_bytes(
            layout,
            tier,
            rank,
            params_on=spec.params_on,
            buffers_on=buffers,
            build_master=build_master,
        )
        out = {k: max(out[k], moved[k]) for k in KINDS}
    return out


def _flatzero_methods(
    spec: PlanSpec, layout: Layout, rates: Rates, states: ModelStates
) -> dict[str, MethodPlan]:
    work = _work(layout)
    after = states.params + states.master + states.grad_shards + states.grad_flat
    out = {}
    for tier in tiers_for(spec):
        moved = _max_over_ranks(layout, tier, spec, build_master=True)
        fill = _max_over_ranks(layout, tier, spec, build_master=False)
        out[tier] = MethodPlan(
            method=tier,
            bytes_moved=moved,
            links=links(moved, nodes=spec.nodes, gpus_per_node=spec.gpus_per_node),
            memory=flatzero_init_memory(
                layout,
                tier,
                params_on=spec.params_on,
                staging_buffers=spec.staging_buffers,
                after=after,
            ),
            time=flatzero_time(tier, fill, work, rates, params_on=spec.params_on),
        )
    return out


def _deepspeed_methods(
    spec: PlanSpec, layout: Layout, rates: Rates
) -> tuple[dict[str, MethodPlan], tuple[str, str], float]:
    """DeepSpeed's two paths, the one 0.19.x takes for the largest group (it decides group
    by group, with the model already moved to the device by its engine), and the seconds
    of that move (``module.to``), which both paths' times and PCIe bytes include."""
    numels = [g.param_numel for g in layout.groups]
    elt = itemsize(spec.dtype)
    ws = spec.world_size
    work = _work(layout)
    flat = max(padded_numel(n, ws) for n in numels) * elt
    if spec.gpu is None:
        path, why = (
            "deepspeed_device",
            ("no accelerator (DS_ACCELERATOR=cpu): torch.cat in host memory, peak 2x the model"),
        )
    else:
        path, why = deepspeed_path(_free(spec, work.param_bytes), flat)
    placement = 0.0
    if spec.gpu is not None and spec.params_on != "device":
        placement = placement_time(work.param_bytes, rates)
    master = sum(deepspeed_master_bytes(n, elt, 0, ws) for n in numels)
    cast = 0 if elt == 4 else master * 4 // (4 + elt)
    out = {}
    for name in ("deepspeed_legacy", "deepspeed_device"):
        moved = deepspeed_bytes(numels, elt, 0, ws, path=name)
        t = deepspeed_time(name, moved, work, rates, master_clone=master - cast, master_cast=cast)
        if placement:  # the engine's module.to(device) comes first
            moved = moved | {"h2d": moved["h2d"] + work.param_bytes}
        out[name] = MethodPlan(
            method=name,
            bytes_moved=moved,
            links=links(moved, nodes=spec.nodes, gpus_per_node=spec.gpus_per_node),
            memory=deepspeed_init_memory(numels, elt, ws, path=name, params_on=spec.params_on),
            time=InitTime(
                name,
                t.seconds + placement,
                {"placement": placement, **t.phases},
                "placement + " + t.combine,
            ),
            note="taken by DeepSpeed 0.19.x here" if name == path else "",
        )
    return out, (path, why), placement


def _free(spec: PlanSpec, on_device: int) -> int:
    """Free device memory per rank at init with ``on_device`` bytes of params there."""
    assert spec.gpu is not None
    return free_at_init(spec.gpu.memory_bytes, spec.reserved_bytes, on_device)


def _decide(spec: PlanSpec, layout: Layout, states: ModelStates, free: int) -> TierDecision:
    """The tier ``auto`` takes (``flatten.choice.choose_tier``'s rules), or the requested one."""
    if spec.tier != "auto" and spec.tier not in tiers_for(spec):
        raise ValueError(
            f"tier {spec.tier!r} cannot run this job (params on {spec.params_on}, "
            f"{'a GPU' if spec.gpu else 'no GPU'}); choose auto or one of {tiers_for(spec)}"
        )
    bucket_bytes = [b.numel * itemsize(g.dtype) for g in layout.groups for b in g.buckets]
    return decide_tier(
        spec.tier,
        params_on="device" if spec.params_on == "device" else "host",
        device_type="cpu" if spec.gpu is None else "cuda",
        world_size=spec.world_size,
        min_free=free,
        largest_bucket_bytes=max(bucket_bytes),
        total_bytes=sum(bucket_bytes),
        shard_bytes=states.master + states.grad_shards,
    )


def _step(spec: PlanSpec, layout: Layout, rates: Rates) -> StepComm:
    """Per-step communication: every bucket reduce-scattered and all-gathered."""
    received = [(b.numel - b.slice_numel, g.dtype) for g in layout.groups for b in g.buckets]
    return step_comm(
        sum(n * itemsize(dtype) for n, dtype in received),
        sum(n for n, _ in received) * itemsize(spec.reduce_dtype),
        stage=spec.stage,
        grad_accum=spec.grad_accum,
        nodes=spec.nodes,
        gpus_per_node=spec.gpus_per_node,
        rates=rates,
    )


HUGE_PAGES_ADVICE_RATIO = 1.25
"""``huge_pages_advice`` speaks when the other allocator's predicted init is this many
times faster."""


def huge_pages_advice(plan: Plan) -> str:
    """Which host allocator a CPU-only job should use: the ``cpu`` tier's predicted init
    with flatzero's 2 MiB pages and with torch's allocator, each at its measured rates; the
    advice when the other one is ``HUGE_PAGES_ADVICE_RATIO`` times faster than the one
    ``spec.host_huge_pages`` asks for, else ``""`` (also without a calibration that has
    both allocators' rates)."""
    spec = plan.spec
    cal = spec.calibration
    if spec.gpu is not None or cal is None or cal.plain_cast_gbps is None:
        return ""
    work = _work(plan.layout)

    def seconds(huge_pages: bool) -> float:
        rates = node_rates(
            None,
            spec.host,
            nodes=spec.nodes,
            ranks_per_node=spec.gpus_per_node,
            calibration=cal,
            huge_pages=huge_pages,
        )
        return flatzero_time("cpu", {}, work, rates, params_on=spec.params_on).seconds

    chosen, other = seconds(spec.host_huge_pages), seconds(not spec.host_huge_pages)
    if chosen < other * HUGE_PAGES_ADVICE_RATIO:
        return ""
    pages = "2 MiB pages" if not spec.host_huge_pages else "torch's allocator"
    return (
        f"{pages} would be faster here by the measured rates ({other:.2f} s against "
        f"{chosen:.2f} s): FlattenConfig(host_huge_pages={not spec.host_huge_pages})"
    )


def new_memory_sizes(plan: Plan) -> dict[str, int]:
    """The sizes of one rank's writes into new host memory, as ``calibration.measure``
    takes them: ``fill_bytes`` the largest bucket, ``cast_bytes`` the fp32 master shard."""
    layout = plan.layout
    buckets = [b.numel * itemsize(g.dtype) for g in layout.groups for b in g.buckets]
    return {"fill_bytes": max(buckets), "cast_bytes": _work(layout).master_bytes}


def _layout(spec: PlanSpec) -> Layout:
    """The model's layout at the job's world size; an optimizer that steps whole matrices
    (``WHOLE_PARAM_OPTIMIZERS``) gets its groups whole-params, as ``ZeroOptimizer`` lays
    them out (``muon.muon_param_groups``)."""
    whole: bool | tuple[int, ...] = False
    if spec.optimizer in WHOLE_PARAM_OPTIMIZERS:
        groups, whole = muon_param_groups(spec.model, spec.dtype, spec.grouping)
    else:
        groups = param_groups(spec.model, spec.dtype, spec.grouping)
    return plan_layout(
        groups,
        world_size=spec.world_size,
        bucket_numel=spec.bucket_numel,
        alignment=spec.alignment,
        whole_params=whole,
    )


def make_plan(spec: PlanSpec) -> Plan:
    """The plan of ``spec`` (see ``Plan``).

    Raises:
        ValueError: a requested tier that cannot run the job, or a model it cannot build.
    """
    layout = _layout(spec)
    states = model_states(
        layout,
        stage=spec.stage,
        optimizer=spec.optimizer,
        staging_buffers=spec.staging_buffers,
        reduce_dtype=spec.reduce_dtype,
        backward_passes=spec.grad_accum,
        host_gloo=spec.gpu is None,
    )
    rates = node_rates(
        spec.gpu,
        spec.host,
        nodes=spec.nodes,
        ranks_per_node=spec.gpus_per_node,
        calibration=spec.calibration,
        huge_pages=spec.host_huge_pages,
    )
    on_device = _work(layout).param_bytes if spec.params_on == "device" else 0
    free = 0 if spec.gpu is None else _free(spec, on_device)
    offload_host = None
    if spec.offload_optimizer:
        offload_host = offload_host_memory(
            layout, optimizer=spec.optimizer, pinned=spec.pin_memory and spec.gpu is not None
        )
        if spec.gpu is not None:  # the master and the optimizer state live on the host
            states = dataclasses.replace(states, master=0, optimizer=0)
    decision = _decide(spec, layout, states, free)
    methods = _flatzero_methods(spec, layout, rates, states)
    deepspeed, ds019, placement = _deepspeed_methods(spec, layout, rates)
    return Plan(
        spec=spec,
        layout=layout,
        states=states,
        decision=decision,
        free_bytes=free,
        methods=methods | deepspeed,
        deepspeed_019=ds019,
        placement_seconds=placement,
        step=_step(spec, layout, rates),
        rates=rates,
        host_ram_bytes=spec.host_ram_bytes or spec.host.memory_bytes,
        offload_host=offload_host,
        async_snapshot=async_snapshot_bytes(layout, optimizer=spec.optimizer),
        largest_gradient=held_gradient_bytes(layout, stage=spec.stage),
        muon=muon_balance(layout),
    )
