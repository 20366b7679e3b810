"""Init benchmark: flatzero's flatten + master shard against DeepSpeed's and the hardware limit.

Every method runs on the same model, alternately, in one run and one process tree:

- ``flatzero``: ``flatten_parameters`` (tier ``auto`` unless ``--tier``), with the master shard.
- ``torch_cat``: DeepSpeed 0.19.x's algorithm (whole-group ``torch.cat`` on the device).
- ``legacy_cpu``: DeepSpeed before PR #7828 (every param to the host, ``cat``, copy back).
- ``deepspeed``: the real ``deepspeed.initialize`` 0.19.8 (ZeRO-2), when importable.

Each trial builds a fresh copy of the model from a pristine host snapshot (not timed),
times the method on every rank, checks every param still holds its values, and frees it.
An untimed warm-up round comes first and the method order rotates between trials: on a
virtual machine, the first touch of guest memory the host has not backed yet costs
several times a memcpy, and whichever method came first would pay it for the others.
The hardware limit is a plain copy of the bytes the flatten must write (the model, plus
the fp32 master shard), measured in the same run: memcpy on the host, device-to-device
copy on a GPU, pinned H2D when the params start in host memory and the buffers go to a GPU.
On the host a second limit is measured too: the first touch of that many bytes of new
memory, which is what a new buffer costs (on a VM, an order of magnitude more than memcpy).

``--settle-s`` sleeps before every trial so that every method starts from cold memory, as
at a job's start (a VM's balloon hands freed guest pages back to the host after 2 s); by
default trials follow each other and may reuse the memory the previous one freed.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flatzero.config import FlattenConfig
from flatzero.cores import core_share
from flatzero.flatten import flatten_parameters
from flatzero.launch import run_ranks
from flatzero.measure import limits
from flatzero.measure.baselines import flatten_legacy_cpu, flatten_torch_cat
from flatzero.models import build_model, count_bytes, count_params, count_tensors
from flatzero.models.bench_models import MODELS
from flatzero.procmem import cpu_seconds, trim_host_memory
from flatzero.testing.deepspeed import prepare_deepspeed, without_unavailable_deepspeed
from flatzero_bench.common.deepspeed_init import time_deepspeed_initialize
from flatzero_bench.common.ranks import backend_for, device_or_default, rank_device, sync
from flatzero_bench.common.results import emit, print_skipped, result_head
from flatzero_bench.common.settings import (
    BENCH_DTYPES,
    TrialsSpec,
    parse_methods,
    spec_from_args,
)
from flatzero_bench.common.trials import rotated, slowest_per_trial
from flatzero_bench.init.options import METHODS

__all__ = ["MODELS", "run"]


@dataclass(frozen=True)
class BenchSpec(TrialsSpec):
    """One benchmark run's settings (identical on every rank): ``TrialsSpec``'s, and

    Attributes:
        tier: flatzero's flatten tier.
        device: ``"cpu"`` or ``"cuda"``: where the buckets go.
        params_on: where the params are before init (``"host"``, ``"pinned"``, ``"device"``).
        with_lm_head: the model with its LM head.
        settle_s: seconds to sleep before every trial.
    """

    tier: str
    device: str
    params_on: str
    with_lm_head: bool
    settle_s: float


@dataclass(frozen=True)
class Trial:
    """One timed init of one method on one rank (seconds, bytes)."""

    method: str
    wall_s: float
    cpu_s: float
    peak_device_bytes: int | None
    tier: str


def _fresh_model(spec: BenchSpec, pristine: dict[str, torch.Tensor], where: torch.device):
    """A new model whose params are fresh tensors holding the pristine values."""
    config = MODELS[spec.model]()
    model = build_model(
        config, device="meta", dtype=BENCH_DTYPES[spec.dtype], with_lm_head=spec.with_lm_head
    )
    model.to_empty(device=where)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(pristine[name])
            if spec.params_on == "pinned":
                p.data = p.data.pin_memory()
        for b in model.buffers():
            b.zero_()
    return model


def _check_values(model: nn.Module, pristine: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        if not torch.equal(p.detach().cpu(), pristine[name]):
            raise AssertionError(f"param {name} changed its values during init")


def _time_method(method: str, model: nn.Module, spec: BenchSpec, rank: int, ws: int) -> Trial:
    device = rank_device(spec.device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    dist.barrier()
    t0, c0 = time.perf_counter(), cpu_seconds()
    tier = method
    if method in ("flatzero", "flatzero_4k"):
        config = FlattenConfig(
            tier=spec.tier,
            device=str(device),
            bucket_numel=spec.bucket_numel,
            progress=False,
            host_huge_pages=method == "flatzero",
        )
        flat = flatten_parameters(model, config=config)
        tier = "+".join(flat.report.tiers)
    elif method == "torch_cat":
        groups = [[p for p in model.parameters() if p.requires_grad]]
        flat = flatten_torch_cat(groups, rank=rank, world_size=ws, device=device)
    elif method == "legacy_cpu":
        groups = [[p for p in model.parameters() if p.requires_grad]]
        flat = flatten_legacy_cpu(groups, rank=rank, world_size=ws, device=device)
    else:
        flat = time_deepspeed_initialize(
            model, stage=2, dtype=spec.dtype, bucket_numel=spec.bucket_numel
        )
    sync(device)
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    if method == "deepspeed":
        wall, cpu = flat.wall_s, flat.cpu_s  # the initialize call alone
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    del flat
    return Trial(method, wall, cpu, peak, tier)


def _limits(spec: BenchSpec, nbytes: int, threads: int, rank: int) -> dict[str, dict[str, Any]]:
    """The copy limit of ``nbytes`` and, on the host, their first touch (all ranks at once)."""
    device = rank_device(spec.device)
    results = []
    dist.barrier()
    if device.type == "cuda" and spec.params_on in ("host", "pinned"):
        results.append(limits.pinned_h2d_seconds(nbytes, device))
    elif device.type == "cuda":
        results.append(limits.device_copy_seconds(nbytes, device))
    else:
        results.append(limits.memcpy_seconds(nbytes, threads=threads))
        dist.barrier()
        results.append(limits.first_touch_seconds(nbytes, threads=threads, repeats=1))
    return {
        "copy" if r.kind != "first_touch" else "first_touch": {
            "kind": r.kind,
            "seconds": r.seconds,
            "gbps": r.gbps,
        }
        for r in results
    }


def _best_limits(runs: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The fastest measurement of each limit."""
    return {key: min((r[key] for r in runs), key=lambda x: x["seconds"]) for key in runs[0]}


def _slowest_limits(ranks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each limit on the slowest rank (the ranks ran at once)."""
    keys = ranks[0]["limits"]
    return {key: max((r["limits"][key] for r in ranks), key=lambda x: x["seconds"]) for key in keys}


def _rank_main(rank: int, ws: int, spec: BenchSpec) -> dict[str, Any]:
    """This rank's timed trials of every method (the order rotating), the limits measured
    before and after them, and the model's sizes."""
    device = rank_device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    config = MODELS[spec.model]()
    source = build_model(
        config, device="cpu", dtype=BENCH_DTYPES[spec.dtype], with_lm_head=spec.with_lm_head
    )
    pristine = {n: p.detach() for n, p in source.named_parameters()}
    meta = build_model(
        config, device="meta", dtype=BENCH_DTYPES[spec.dtype], with_lm_head=spec.with_lm_head
    )
    model_bytes = count_bytes(meta)
    shard_numel = count_params(meta) / ws
    must_write = model_bytes + int(shard_numel * 4)  # the buckets plus the fp32 master shard
    threads = core_share(None).threads  # the limit may use every core a rank may use
    where = device if spec.params_on == "device" else torch.device("cpu")
    trials: list[Trial] = []
    limit_runs = [_limits(spec, must_write, threads, rank)]
    if "deepspeed" in spec.methods:
        prepare_deepspeed()  # one-off imports and warm-up, outside the timed trials
    for trial in range(spec.warmup + spec.trials):
        # Rotate the order so no method is always the first to touch fresh memory.
        for method in rotated(spec.methods, trial):
            model = _fresh_model(spec, pristine, where)
            trim_host_memory()  # every method starts from the same allocator state
            time.sleep(spec.settle_s)
            result = _time_method(method, model, spec, rank, ws)
            if trial >= spec.warmup:
                trials.append(result)
            _check_values(model, pristine)
            del model
            trim_host_memory()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    limit_runs.append(_limits(spec, must_write, threads, rank))
    return {
        "trials": [asdict(t) for t in trials],
        "limits": _best_limits(limit_runs),
        "model_bytes": model_bytes,
        "must_write_bytes": must_write,
        "params": count_params(meta),
        "tensors": count_tensors(meta),
        "threads": threads,
    }


def _summarize(ws: int, ranks: list[dict[str, Any]], spec: BenchSpec) -> list[dict[str, Any]]:
    """One row per method: median over trials of the slowest rank."""
    limits_here = _slowest_limits(ranks)
    rows = []
    for method in spec.methods:
        per_rank = [[t for t in r["trials"] if t["method"] == method] for r in ranks]
        walls = slowest_per_trial([[t["wall_s"] for t in mine] for mine in per_rank])
        cpus = slowest_per_trial([[t["cpu_s"] for t in mine] for mine in per_rank])
        peaks = [t["peak_device_bytes"] for mine in per_rank for t in mine]
        wall = statistics.median(walls)
        rows.append(
            {
                "world_size": ws,
                "method": method,
                "tier": per_rank[0][0]["tier"],
                "wall_s": wall,
                "wall_s_trials": walls,
                "cpu_s_per_rank": statistics.median(cpus),
                "cpu_over_wall": statistics.median(cpus) / wall,
                "model_gbps": ranks[0]["model_bytes"] / wall / 1e9,
                "x_limit": wall / limits_here["copy"]["seconds"],
                "x_first_touch": (
                    wall / limits_here["first_touch"]["seconds"]
                    if "first_touch" in limits_here
                    else None
                ),
                "peak_device_bytes": max(peaks) if None not in peaks else None,
            }
        )
    flatzero = next((r for r in rows if r["method"] == "flatzero"), None)
    for row in rows:
        row["x_flatzero"] = row["wall_s"] / flatzero["wall_s"] if flatzero else None
    return rows


def _table(rows: list[dict[str, Any]], limits_by_ws: dict[int, dict[str, Any]]) -> str:
    head = (
        f"{'ranks':>5} {'method':<11} {'tier':<8} {'time s':>8} {'GB/s':>7} {'x copy':>7} "
        f"{'x 1st touch':>11} {'vs flatzero':>11} {'CPU s/rank':>10} {'CPU/wall':>8} "
        f"{'peak dev GiB':>12}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        peak = "-" if r["peak_device_bytes"] is None else f"{r['peak_device_bytes'] / 2**30:.2f}"
        touch = "-" if r["x_first_touch"] is None else f"{r['x_first_touch']:.2f}"
        lines.append(
            f"{r['world_size']:>5} {r['method']:<11} {r['tier']:<8} {r['wall_s']:>8.3f} "
            f"{r['model_gbps']:>7.2f} {r['x_limit']:>7.2f} {touch:>11} {r['x_flatzero']:>10.2f}x "
            f"{r['cpu_s_per_rank']:>10.2f} {r['cpu_over_wall']:>8.2f} {peak:>12}"
        )
    for ws, by_kind in limits_by_ws.items():
        for lim in by_kind.values():
            lines.append(
                f"limit at {ws} rank(s): {lim['kind']} of the bytes init must write, "
                f"{lim['seconds']:.3f} s ({lim['gbps']:.2f} GB/s)"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table and one JSON line."""
    args.device = device_or_default(args.device, "cpu")
    methods = parse_methods(args.methods, METHODS)
    if args.settle_s < 0:
        raise SystemExit(f"--settle-s {args.settle_s} must be >= 0")
    methods, skipped = without_unavailable_deepspeed(methods)
    spec = spec_from_args(BenchSpec, args, methods=methods, with_lm_head=not args.no_lm_head)
    rows, limits_by_ws, info = [], {}, {}
    for ws in (int(w) for w in args.world_sizes.split(",")):
        ranks = run_ranks(_rank_main, ws, spec, backend=backend_for(spec.device), timeout_s=1800)
        rows.extend(_summarize(ws, ranks, spec))
        limits_by_ws[ws] = _slowest_limits(ranks)
        info = {k: ranks[0][k] for k in ("model_bytes", "params", "tensors")}
    print(f"model {spec.model}: {info['params'] / 1e9:.3f}B params, {info['tensors']} tensors, ")
    print(f"{info['model_bytes'] / 2**30:.2f} GiB in {spec.dtype}; {platform.node()}")
    print_skipped(skipped)
    print(_table(rows, limits_by_ws))
    result = {
        **result_head("init", args),
        "machine": {
            "cpus": os.cpu_count(),
            "device": torch.cuda.get_device_name() if spec.device == "cuda" else "cpu",
            "torch": torch.__version__,
        },
        "spec": asdict(spec),
        "model": info,
        "limits": limits_by_ws,
        "rows": rows,
        "skipped": skipped,
    }
    emit(result, args.json)
    return 0
