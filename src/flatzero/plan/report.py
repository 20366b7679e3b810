"""A plan as a table for people and as a dict for ``--json``."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..words import plural
from .advice import fit_advice, fit_advice_lines
from .comm_estimate import ExposedComm, plan_exposed_comm
from .memory_model import itemsize
from .planner import MethodPlan, Plan, huge_pages_advice

__all__ = ["format_plan", "plan_to_dict"]

_GIB = 2**30
_LINKS = ("hbm", "host_memory", "pcie_h2d", "pcie_d2h", "intra_node", "network")
_LINK_HEAD = ("HBM", "host mem", "PCIe H2D", "PCIe D2H", "NVLink", "network")
_LABELS = {
    "deepspeed_legacy": "DeepSpeed legacy CPU cat",
    "deepspeed_device": "DeepSpeed 0.19 device cat",
}


def _gib(nbytes: float) -> str:
    return f"{nbytes / _GIB:.2f}"


def _model_line(plan: Plan) -> str:
    spec = plan.spec
    layout = plan.layout
    numel = layout.param_numel
    nbytes = sum(g.param_numel * itemsize(g.dtype) for g in layout.groups)
    buckets = sum(len(g.buckets) for g in layout.groups)
    padding = sum(g.padding_numel for g in layout.groups)
    layers = spec.model.num_hidden_layers
    head = "" if spec.model.with_lm_head else ", no lm_head"
    shape = spec.model.kind + ("" if layers is None else f", {layers} layers") + head
    return (
        f"model {spec.model.name} ({shape}): "
        f"{numel / 1e9:.3f}B params in {layout.num_params:,} tensors, {_gib(nbytes)} GiB "
        f"{spec.dtype}; {buckets} buckets of <= {spec.bucket_numel:,} elements, padding "
        f"{100 * padding / max(1, numel):.3f}%"
    )


def _memory_lines(plan: Plan) -> list[str]:
    s = plan.states
    spec = plan.spec
    grads = f"fp32 shard {_gib(s.grad_shards)}"
    if s.grad_flat:
        grads += f" + flat buffer {_gib(s.grad_flat)}"
    if s.grad_staging:
        grads += f" + staging {_gib(s.grad_staging)}"
    where = "host" if spec.gpu is None else spec.gpu.name
    lines = [
        "per rank, after the first step (GiB):",
        f"  params (flat buckets)      {_gib(s.params):>10}",
        f"  gradients (stage {spec.stage})       {_gib(s.gradients):>10}   ({grads})",
        f"  fp32 master shard          {_gib(s.master):>10}",
        f"  optimizer ({spec.optimizer:<8})       {_gib(s.optimizer):>10}",
        f"  model states               {_gib(s.total):>10}   on {where}",
        f"  + in backward, a moment    {_gib(plan.largest_gradient):>10}   (autograd's largest "
        "gradient, at least)",
    ]
    if spec.gpu is not None:
        fits = "fit" if s.total + plan.largest_gradient <= plan.free_bytes else "DO NOT FIT"
        lines.append(
            f"  free at init               {_gib(plan.free_bytes):>10}   of "
            f"{_gib(spec.gpu.memory_bytes)} ({_gib(spec.reserved_bytes)} reserved): model "
            f"states and that gradient {fits} (activations not counted)"
        )
    return lines


def _muon_lines(plan: Plan) -> list[str]:
    """With ``--optimizer muon``: the matrices' owners, their Newton-Schulz balance, and the
    Muon groups' per-rank shards (equal on every rank) against the matrices each rank owns."""
    m = plan.muon
    if m is None:
        return []
    mean = sum(m.owned_numel) / len(m.owned_numel)
    params = sum(m.owned_numel)
    return [
        f"  muon: {m.matrices} matrices whole on owner ranks, each orthogonalized once per "
        f"step; Newton-Schulz work max/mean {m.balance:.3f} (rank {m.busiest_rank})",
        f"  muon: momentum {_gib(m.shard_numel * 4)} GiB fp32 on every rank (shards padded to "
        f"the fullest rank's part: padding {100 * m.padding_numel / max(1, params):.2f}%), "
        f"of it the owned matrices' {_gib(min(m.owned_numel) * 4)}-"
        f"{_gib(max(m.owned_numel) * 4)} GiB (max/mean {max(m.owned_numel) / max(1.0, mean):.3f})",
    ]


def _async_save_lines(plan: Plan) -> list[str]:
    """The host copy an asynchronous save keeps per rank: its bytes when configured, else
    what it would cost."""
    spec = plan.spec
    nbytes, ranks = plan.async_snapshot, spec.gpus_per_node
    pinned = ", page-locked" if spec.gpu is not None else ""
    node = f"{ranks} x {_gib(nbytes)} = {_gib(ranks * nbytes)} GiB host RAM per node"
    if spec.async_save:
        return [
            f"  async save snapshot (host) {_gib(nbytes):>10}   (fp32 master + "
            f"{spec.optimizer} state shards, page-aligned{pinned}, kept from the first save; "
            f"{node})"
        ]
    return [
        f"  (async save, not configured, would keep {_gib(nbytes)} GiB of host memory per "
        f"rank{pinned}: {node}; --async-save)"
    ]


def _offload_lines(plan: Plan) -> list[str]:
    """With optimizer offload: its host bytes per rank (the formula) and per node."""
    h = plan.offload_host
    if h is None:
        return []
    spec = plan.spec
    ranks = spec.gpus_per_node
    node = ranks * h.total
    fits = "fits" if node <= plan.host_ram_bytes else "DOES NOT FIT"
    pinned = f"; {_gib(h.pinned)} page-locked" if h.pinned else ""
    return [
        "optimizer offload (offload_optimizer: cpu), host memory per rank (GiB):",
        f"  fp32 master shard          {_gib(h.master):>10}",
        f"  optimizer ({spec.optimizer:<8})       {_gib(h.state):>10}",
        f"  fp32 gradient shard        {_gib(h.grads):>10}   (the downloads land in it and "
        f"the upload is staged in it: no other staging{pinned})",
        f"  peak per rank              {_gib(h.total):>10}   = 4 B x shard elements x (2 + "
        f"optimizer state tensors); {ranks} x {_gib(h.total)} = {_gib(node)} GiB per node "
        f"({fits} in {_gib(plan.host_ram_bytes)})",
    ]


def _method_row(m: MethodPlan, chosen: bool, usable: int | None) -> str:
    label = _LABELS.get(m.method, f"flatzero {m.method}") + (" *" if chosen else "")
    cells = " ".join(f"{_gib(m.links[k]):>9}" for k in _LINKS)
    fits = "-" if usable is None else ("yes" if m.memory.device_peak <= usable else "NO")
    return (
        f"  {label:<29} {_gib(m.memory.device_peak):>9} {fits:>4} {_gib(m.memory.host_peak):>9} "
        f"{cells} {m.time.seconds:>9.2f}"
    )


def _legacy_lower_bound(ranks: int) -> str:
    """What the DeepSpeed legacy row's time leaves out, said beside it."""
    return (
        "  (the legacy CPU cat's time is a lower bound: its bytes at these rates, without "
        f"{plural(ranks, 'rank')} each running its host work on every core at once, which "
        "DeepSpeed #7677 found to dominate: docs/plan.md)"
    )


def _init_lines(plan: Plan) -> list[str]:
    heads = ("host peak", *_LINK_HEAD, "time s")
    head = f"{'dev peak':>9} {'fits':>4} " + " ".join(f"{h:>9}" for h in heads)
    lines = [f"{'init, per rank (GiB; * = taken)':<31} {head}"]
    spec = plan.spec
    usable = None if spec.gpu is None else spec.gpu.memory_bytes - spec.reserved_bytes
    ds_path = plan.deepspeed_019[0]
    for m in plan.methods.values():
        lines.append(_method_row(m, m.method in (plan.decision.tier, ds_path), usable))
    if "deepspeed_legacy" in plan.methods:
        lines.append(_legacy_lower_bound(spec.gpus_per_node))
    tier = plan.decision.tier or "none (MemoryError on every rank)"
    lines.append(f"flatzero auto -> {tier}: {plan.decision.reason}")
    lines.append(f"DeepSpeed 0.19.x -> {ds_path}: {plan.deepspeed_019[1]}")
    if plan.placement_seconds:
        lines.append(
            f"DeepSpeed's times include {plan.placement_seconds:.2f} s of moving the host "
            "params to the GPU first (module.to, pageable)"
        )
    return lines


def _host_lines(plan: Plan) -> list[str]:
    ranks = plan.spec.gpus_per_node
    ram = plan.host_ram_bytes
    lines = [f"host RAM per node ({ranks} rank(s), {_gib(ram)} GiB):"]
    shown = [t for t in (plan.decision.tier, plan.deepspeed_019[0], "deepspeed_legacy") if t]
    for name in dict.fromkeys(shown):
        if name not in plan.methods:
            continue
        m = plan.methods[name]
        total = ranks * m.memory.host_peak
        fits = "fits" if total <= ram else "DOES NOT FIT"
        label = _LABELS.get(name, f"flatzero {name}")
        lines.append(
            f"  {label:<29} {ranks} x {_gib(m.memory.host_peak)} = {_gib(total)} GiB peak "
            f"({fits}); model copies before init {ranks} x {_gib(m.memory.host_model_copy)}"
        )
    return lines


def _exposed(plan: Plan) -> ExposedComm:
    spec = plan.spec
    return plan_exposed_comm(
        plan.layout,
        reduce_dtype=spec.reduce_dtype,
        stage=spec.stage,
        grad_accum=spec.grad_accum,
        rates=plan.rates,
    )


def _step_and_rates(plan: Plan) -> list[str]:
    st = plan.step
    r = plan.rates
    ex = _exposed(plan)
    lines = [
        f"per step, per rank: reduce-scatter {_gib(st.reduce_scatter_bytes)} GiB + all-gather "
        f"{_gib(st.all_gather_bytes)} GiB received, {_gib(st.network_bytes)} GiB per NIC; "
        f"{st.seconds:.3f} s at {r.collective_gbps:.0f} GB/s bus bandwidth",
        f"exposed communication per step: {1e3 * ex.without_overlap_s:.1f} ms without "
        f"overlap (all {ex.buckets} buckets' all-gathers and reductions), "
        f"{1e3 * ex.with_overlap_s:.1f} ms with overlap (one bucket's all-gather + one "
        "reduction)",
    ]
    fields = [
        (f.name.removesuffix("_gbps"), getattr(r, f.name))
        for f in dataclasses.fields(r)
        if f.name.endswith("_gbps")
    ]
    rates = ", ".join(f"{n} {v:.1f} ({r.origin.get(n, '?')})" for n, v in fields)
    tensor = ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in r.tensor_seconds.items())
    lines.append(f"rates per rank, GB/s: {rates}; per tensor: {tensor}")
    if advice := huge_pages_advice(plan):
        lines.append(f"host memory: {advice}")
    return lines


def format_plan(plan: Plan) -> str:
    """The plan as a table (several lines)."""
    spec = plan.spec
    where = "CPU" if spec.gpu is None else spec.gpu.name
    title = (
        f"flatzero plan: {spec.nodes} node(s) x {spec.gpus_per_node} {where}, {spec.dtype}, "
        f"ZeRO-{spec.stage}, {spec.optimizer}, params start on {spec.params_on}"
    )
    return "\n".join(
        [
            title,
            _model_line(plan),
            *_memory_lines(plan),
            *_muon_lines(plan),
            *fit_advice_lines(plan),
            *_async_save_lines(plan),
            *_offload_lines(plan),
            *_init_lines(plan),
            *_host_lines(plan),
            *_step_and_rates(plan),
        ]
    )


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The plan as JSON-serializable data (bytes, seconds, GB/s)."""
    spec = plan.spec
    layout = plan.layout
    return {
        "spec": {
            **{
                k: v
                for k, v in vars(spec).items()
                if k not in ("model", "gpu", "host", "calibration")
            },
            "model": spec.model.describe(),
            "gpu": None if spec.gpu is None else dataclasses.asdict(spec.gpu),
            "host": dataclasses.asdict(spec.host),
            "world_size": spec.world_size,
        },
        "layout": {
            "params": layout.param_numel,
            "tensors": layout.num_params,
            "groups": [
                {
                    "dtype": g.dtype,
                    "buckets": len(g.buckets),
                    "numel": g.numel,
                    "padding": g.padding_numel,
                    "shard_numel": g.shard_numel,
                }
                for g in layout.groups
            ],
        },
        "per_rank": {
            **dataclasses.asdict(plan.states),
            "gradients": plan.states.gradients,
            "total": plan.states.total,
        },
        "async_save_snapshot_bytes": plan.async_snapshot,
        "largest_gradient_bytes": plan.largest_gradient,
        "muon": None
        if plan.muon is None
        else dataclasses.asdict(plan.muon) | {"balance": plan.muon.balance},
        "free_bytes": plan.free_bytes,
        "auto": dataclasses.asdict(plan.decision),
        "deepspeed_019": {"path": plan.deepspeed_019[0], "reason": plan.deepspeed_019[1]},
        "deepspeed_placement_seconds": plan.placement_seconds,
        "methods": {
            name: {
                "bytes_moved": m.bytes_moved,
                "links": m.links,
                "memory": dataclasses.asdict(m.memory),
                "host_ram_per_node": m.memory.host_peak * spec.gpus_per_node,
                "time": dataclasses.asdict(m.time),
                "note": m.note,
            }
            for name, m in plan.methods.items()
        },
        "host_ram_bytes": plan.host_ram_bytes,
        "offload_host": None
        if plan.offload_host is None
        else dataclasses.asdict(plan.offload_host) | {"total": plan.offload_host.total},
        "step": dataclasses.asdict(plan.step),
        "exposed_comm": dataclasses.asdict(_exposed(plan)),
        "rates": dataclasses.asdict(plan.rates),
        "calibration": None if spec.calibration is None else spec.calibration.to_dict(),
        "huge_pages_advice": huge_pages_advice(plan),
        "fit_advice": None if (advice := fit_advice(plan)) is None else dataclasses.asdict(advice),
    }
