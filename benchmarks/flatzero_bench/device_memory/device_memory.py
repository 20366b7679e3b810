"""Peak device memory and bytes moved at init: flatzero against DeepSpeed's torch.cat.

On each rank, for a model of ``init``'s zoo, with the params first on the device and then
in host memory, in this order in one run:

- ``flatzero``: ``flatten_parameters`` (tier ``auto``);
- ``torch_cat``: DeepSpeed 0.19's on-device flatten (PR #7828): one ``torch.cat`` of each
  group with every original alive, then this rank's fp32 master partition;

each from a fresh model, measured with the device's own counters
(``memory_allocated``/``max_memory_allocated``, through the device seam), in bytes above
what was in use before the method started:

- ``peak``: the highest point during init; ``held``: what stays at its end;
- ``transient = peak - held``: memory init needs only while it runs, the figure that
  decides whether a model that trains also initializes (flatzero: one bucket at most;
  DeepSpeed's ``torch.cat``: the whole model, the originals beside the copy);
- the floor, the same run's limit: what any ZeRO-1/2 init must add, this rank's fp32
  master shard, plus the flat buffers (the model) when the params start in host memory;
  each peak is also reported as a multiple of it.

``--device emu`` runs on the emulated accelerator of ``flatzero.testing.emulated`` (CPU
memory counted like a device's), so the memory and bytes columns are exact on a machine
without a GPU; its times mean nothing and are not reported. On CUDA the same counters are
the caching allocator's.
"""

from __future__ import annotations

import argparse
import functools
import gc
import platform
from dataclasses import asdict, dataclass
from typing import Any

import torch

from flatzero import accel
from flatzero.config import FlattenConfig
from flatzero.flatten import flatten_parameters
from flatzero.launch import run_ranks
from flatzero.measure.baselines import flatten_torch_cat
from flatzero.models import build_model, count_bytes, count_params
from flatzero_bench.common.ranks import device_or_default, rank_device
from flatzero_bench.common.results import emit, result_head
from flatzero_bench.common.settings import BENCH_DTYPES
from flatzero_bench.init.init_bench import MODELS

__all__ = ["run"]

PLACEMENTS = ("device", "host")
"""Where the params are before init."""


@dataclass(frozen=True)
class MemorySpec:
    """One run's settings (identical on every rank).

    Attributes:
        model: a model of ``init_bench.MODELS``.
        dtype: the params' dtype (``bf16``, ``fp32``, ...).
        device: the accelerator type (``emu`` or ``cuda``).
        bucket_numel: flatzero's bucket size (elements).
    """

    model: str
    dtype: str
    device: str
    bucket_numel: int


@dataclass(frozen=True)
class Measured:
    """One method's init on one rank (bytes)."""

    method: str
    params_on: str
    tier: str
    peak_extra_bytes: int
    held_after_bytes: int
    moved: dict[str, int]


def _model(spec: MemorySpec, where: torch.device) -> torch.nn.Module:
    config = MODELS[spec.model]()
    return build_model(config, device=where, dtype=BENCH_DTYPES[spec.dtype], seed=0)


def _measure(method: str, params_on: str, spec: MemorySpec, rank: int, ws: int) -> Measured:
    device = rank_device(spec.device)
    where = device if params_on == "device" else torch.device("cpu")
    model = _model(spec, where)
    gc.collect()
    accel.synchronize(device)
    base = accel.memory_allocated(device)
    accel.reset_peak_memory_stats(device)
    if method == "flatzero":
        flat = flatten_parameters(
            model,
            config=FlattenConfig(
                device=str(device), bucket_numel=spec.bucket_numel, progress=False
            ),
        )
        tier, moved = "+".join(flat.report.tiers), dict(flat.report.bytes_moved)
    else:
        groups = [[p for p in model.parameters() if p.requires_grad]]
        flat = flatten_torch_cat(groups, rank=rank, world_size=ws, device=device)
        placed = count_bytes(model) if params_on == "host" else 0  # module.to(device) first
        tier, moved = "torch_cat", {"device_copy": flat.bytes_moved, "h2d": placed}
    accel.synchronize(device)
    peak = accel.max_memory_allocated(device) - base
    held = accel.memory_allocated(device) - base
    del flat, model
    gc.collect()
    return Measured(method, params_on, tier, peak, held, moved)


def _rank_main(rank: int, ws: int, spec: MemorySpec) -> dict[str, Any]:
    meta = _model(spec, torch.device("meta"))
    model_bytes = count_bytes(meta)
    params = count_params(meta)
    rows = [
        asdict(_measure(method, params_on, spec, rank, ws))
        for params_on in PLACEMENTS
        for method in ("flatzero", "torch_cat")
    ]
    return {"rows": rows, "model_bytes": model_bytes, "params": params}


def _floor(model_bytes: int, params: int, ws: int, params_on: str) -> int:
    """Bytes any init must add on the device: this rank's fp32 master shard, and the
    model's flat buffers when the params start in host memory (padding left out: a lower
    bound)."""
    master = -(-params // ws) * 4
    return master + (model_bytes if params_on == "host" else 0)


def _summarize(ws: int, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (params_on, method): the largest peak over the ranks."""
    model_bytes, params = ranks[0]["model_bytes"], ranks[0]["params"]
    out = []
    for i, row in enumerate(ranks[0]["rows"]):
        peak = max(r["rows"][i]["peak_extra_bytes"] for r in ranks)
        transient = max(
            r["rows"][i]["peak_extra_bytes"] - r["rows"][i]["held_after_bytes"] for r in ranks
        )
        floor = _floor(model_bytes, params, ws, row["params_on"])
        out.append(
            {
                **row,
                "world_size": ws,
                "peak_extra_bytes": peak,
                "transient_bytes": transient,
                "transient_x_model": transient / model_bytes,
                "floor_bytes": floor,
                "x_floor": peak / floor,
            }
        )
    for row in out:
        same = next(
            r for r in out if r["params_on"] == row["params_on"] and r["method"] == "flatzero"
        )
        row["x_flatzero"] = row["peak_extra_bytes"] / same["peak_extra_bytes"]
    return out


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'ranks':>5} {'params on':<9} {'method':<10} {'tier':<8} {'peak MiB':>9} "
        f"{'x floor':>8} {'vs flatzero':>11} {'held MiB':>9} {'transient MiB':>13} "
        f"{'x model':>7} {'h2d MiB':>8} {'all-gather MiB':>14}"
    )
    lines = [head, "-" * len(head)]
    mib = 2**20
    for r in rows:
        lines.append(
            f"{r['world_size']:>5} {r['params_on']:<9} {r['method']:<10} {r['tier']:<8} "
            f"{r['peak_extra_bytes'] / mib:>9.1f} {r['x_floor']:>8.2f} "
            f"{r['x_flatzero']:>10.2f}x {r['held_after_bytes'] / mib:>9.1f} "
            f"{r['transient_bytes'] / mib:>13.1f} {r['transient_x_model']:>7.2f} "
            f"{r['moved'].get('h2d', 0) / mib:>8.1f} {r['moved'].get('all_gather', 0) / mib:>14.1f}"
        )
    floors = sorted({(r["world_size"], r["params_on"], r["floor_bytes"]) for r in rows})
    for ws, params_on, floor in floors:
        what = "fp32 master shard" + (" + flat buffers" if params_on == "host" else "")
        lines.append(f"floor, {ws} rank(s), params on {params_on}: {what} = {floor / mib:.1f} MiB")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table and one JSON line."""
    args.device = device_or_default(args.device, "emu")
    spec = MemorySpec(args.model, args.dtype, args.device, args.bucket_numel)
    if spec.device == "emu":
        from flatzero.testing.emulated import install

        prepare = functools.partial(install, "emu", capacity_bytes=int(args.capacity_gib * 2**30))
        backend = "cpu:gloo,emu:emu-gloo"
    else:
        prepare, backend = None, "nccl"
    rows: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    for ws in (int(w) for w in args.world_sizes.split(",")):
        ranks = run_ranks(_rank_main, ws, spec, backend=backend, prepare=prepare, timeout_s=1800)
        rows.extend(_summarize(ws, ranks))
        info = {k: ranks[0][k] for k in ("model_bytes", "params")}
    print(f"model {spec.model}: {info['params'] / 1e6:.1f}M params, ")
    print(
        f"{info['model_bytes'] / 2**20:.1f} MiB in {spec.dtype}; {spec.device} on {platform.node()}"
    )
    print(_table(rows))
    result = {
        **result_head("device-memory", args),
        "machine": {"host": platform.node(), "device": spec.device, "torch": torch.__version__},
        "spec": asdict(spec),
        "model": info,
        "rows": rows,
    }
    emit(result, args.json)
    return 0
