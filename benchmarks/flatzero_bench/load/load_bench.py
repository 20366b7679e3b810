"""Load benchmark: direct load into the flat buffers against a full load plus flatten.

The same safetensors checkpoint (HF names, one file, written once at the start of the
run) is loaded by every method, alternately, in one run and one process tree:

- ``full``: what ``from_pretrained`` then ZeRO init does: the model is built on the meta
  device, every rank reads every tensor of the checkpoint into host memory (a
  materialized model: the whole model per rank), then ``flatten_parameters`` copies the
  params into the flat buffers.
- ``direct``: ``flatzero.loading.load_flat`` on the meta model, tier ``auto``: the
  checkpoint's bytes go straight into the flat buffers, no intermediate model.
- ``direct_sharded``: ``load_flat`` with tier ``sharded``: each rank reads only its
  slices of each bucket, an all-gather fills the rest.

Per trial and rank: wall seconds of the load, CPU seconds, peak RSS above the RSS before
the trial (the kernel's high-water mark, reset before each trial), bytes read from the
checkpoint file (``/proc/self/io`` ``rchar``; reads through a memory map are not counted
there, so ``full``, which maps the file, also reports the bytes it materializes). The
limit in the same run is a plain memcpy of the model's bytes on one rank. The checkpoint
file is in the page cache for every trial (it was just written and is re-read each
trial), so this measures the CPU and memory work, not the disk. After every trial each
rank checks the flat buffers against the checkpoint (float64 sums per bucket).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from flatzero.config import FlattenConfig
from flatzero.flatten import flatten_parameters
from flatzero.launch import run_ranks
from flatzero.measure.limits import memcpy_seconds
from flatzero.models import build_model, count_bytes, count_params, load_model_safetensors
from flatzero.models import save_model_safetensors as save_model
from flatzero.procmem import (
    cpu_seconds,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
    trim_host_memory,
)
from flatzero_bench.common.results import result_head
from flatzero_bench.common.settings import BENCH_DTYPES, TrialsSpec, parse_methods, spec_from_args
from flatzero_bench.common.trials import rotated, slowest_per_trial
from flatzero_bench.init.init_bench import MODELS
from flatzero_bench.load.options import METHODS, add_arguments

__all__ = ["METHODS", "LoadSpec", "add_arguments", "run"]


@dataclass(frozen=True)
class LoadSpec(TrialsSpec):
    """One benchmark run's settings (identical on every rank): ``TrialsSpec``'s (``model``
    a key of ``init_bench.MODELS``, ``dtype`` the checkpoint's and the params'), and

    Attributes:
        build_master: also build the fp32 master shard (the same work in every method).
        checkpoint: path of the safetensors file.
    """

    build_master: bool
    checkpoint: str


@dataclass(frozen=True)
class LoadTrial:
    """One timed load on one rank (seconds, bytes)."""

    method: str
    wall_s: float
    cpu_s: float
    peak_rss_delta_bytes: int
    read_bytes: int
    tier: str


def _read_chars() -> int:
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _meta_model(spec: LoadSpec):
    return build_model(MODELS[spec.model](), device="meta", dtype=BENCH_DTYPES[spec.dtype])


def _load(spec: LoadSpec, method: str):
    config = FlattenConfig(
        bucket_numel=spec.bucket_numel,
        progress=False,
        device="cpu",
        build_master=spec.build_master,
        tier="sharded" if method == "direct_sharded" else "auto",
    )
    model = _meta_model(spec)
    if method == "full":
        load_model_safetensors(model, spec.checkpoint)
        return model, flatten_parameters(model, config=config)
    from flatzero.loading import load_flat

    return model, load_flat(model, spec.checkpoint, config=config)


def _check(flat, expected: dict[str, float]) -> None:
    for g in flat.groups:
        for b, bucket in enumerate(g.buckets):
            names = [g.names[i] for i in g.layout.buckets[b].slots]
            want = sum(expected[n] for n in names)
            got = float(bucket.double().sum())
            if abs(got - want) > 1e-6 * max(1.0, abs(want)):
                raise AssertionError(f"bucket {b} of group {g.layout.group_index} is wrong")


def _timed_load(spec: LoadSpec, method: str, expected: dict[str, float]) -> LoadTrial:
    """One load by ``method`` after a barrier, from the same allocator state; checked."""
    trim_host_memory()
    dist.barrier()
    reset_peak_rss()
    before = rss_bytes()
    read0, cpu0 = _read_chars(), cpu_seconds()
    t0 = time.perf_counter()
    model, flat = _load(spec, method)
    wall = time.perf_counter() - t0
    cpu = cpu_seconds() - cpu0
    read = _read_chars() - read0
    peak = peak_rss_bytes() - before
    _check(flat, expected)
    tier = flat.report.groups[0].tier if flat.report.groups else "?"
    del model, flat
    return LoadTrial(method, wall, cpu, max(0, peak), read, tier)


def _rank_main(rank: int, world_size: int, spec: LoadSpec, expected: dict[str, float]) -> dict:
    """This rank's trials (the method order rotating every round) and its memcpy limit."""
    torch.manual_seed(0)
    trials: list[LoadTrial] = []
    for round_index in range(spec.warmup + spec.trials):
        for method in rotated(spec.methods, round_index):
            trial = _timed_load(spec, method, expected)
            if round_index >= spec.warmup:
                trials.append(trial)
    # the limit: a memcpy of the checkpoint's bytes
    memcpy = memcpy_seconds(os.path.getsize(spec.checkpoint), repeats=3)
    return {"trials": [asdict(t) for t in trials], "memcpy_s": memcpy.seconds}


def _summary(ranks: list[dict], spec: LoadSpec) -> list[dict[str, Any]]:
    """One row per method: the slowest rank's wall seconds per trial (median and min), and
    over every trial and rank the median CPU seconds and bytes read, the largest peak RSS."""
    rows = []
    for method in spec.methods:
        mine = [[t for t in r["trials"] if t["method"] == method] for r in ranks]
        walls = slowest_per_trial([[t["wall_s"] for t in trials] for trials in mine])
        every = [t for trials in mine for t in trials]
        rows.append(
            {
                "method": method,
                "tier": mine[0][0]["tier"],
                "wall_s_median": statistics.median(walls),
                "wall_s_min": min(walls),
                "cpu_s_median_per_rank": statistics.median(t["cpu_s"] for t in every),
                "peak_rss_delta_bytes_max": max(t["peak_rss_delta_bytes"] for t in every),
                "read_bytes_per_rank": statistics.median(t["read_bytes"] for t in every),
            }
        )
    return rows


def _write_checkpoint(
    args: argparse.Namespace, path: Path
) -> tuple[dict[str, float], dict[str, int]]:
    """Build the model (seed 0) and save it to ``path``; returns each param's float64 sum
    and the model's ``params`` and ``model_bytes``."""
    model = build_model(MODELS[args.model](), device="cpu", dtype=BENCH_DTYPES[args.dtype], seed=0)
    expected = {n: float(p.detach().double().sum()) for n, p in model.named_parameters()}
    info = {"params": count_params(model), "model_bytes": count_bytes(model)}
    save_model(model, path)
    return expected, info


def _print_table(
    args: argparse.Namespace, info: dict[str, Any], rows: list[dict[str, Any]], memcpy: float
) -> None:
    """The model and the limit (``memcpy`` seconds), then a line per method."""
    base = next((r for r in rows if r["method"] == "full"), rows[0])
    print(
        f"model {args.model} ({info['params'] / 1e6:.0f}M params, "
        f"{info['model_bytes'] / 2**30:.2f} GiB {args.dtype}), world size {args.world_size}, "
        f"{args.trials} trials; memcpy of the model {memcpy:.3f} s"
    )
    print(
        f"{'method':<16}{'tier':<9}{'wall s':>8}{'vs full':>9}{'cpu s/rank':>12}"
        f"{'peak RSS +GiB':>15}{'read GiB/rank':>15}"
    )
    for r in rows:
        print(
            f"{r['method']:<16}{r['tier']:<9}{r['wall_s_median']:>8.3f}"
            f"{base['wall_s_median'] / r['wall_s_median']:>8.2f}x"
            f"{r['cpu_s_median_per_rank']:>12.3f}"
            f"{r['peak_rss_delta_bytes_max'] / 2**30:>15.2f}"
            f"{r['read_bytes_per_rank'] / 2**30:>15.2f}"
        )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table and write/print one JSON result."""
    methods = parse_methods(args.methods, METHODS)
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        path = Path(workdir) / "model.safetensors"
        expected, info = _write_checkpoint(args, path)
        spec = spec_from_args(
            LoadSpec, args, methods=methods, build_master=args.master, checkpoint=str(path)
        )
        ranks = run_ranks(_rank_main, args.world_size, spec, expected, timeout_s=1800)
    rows = _summary(ranks, spec)
    memcpy = min(r["memcpy_s"] for r in ranks)
    _print_table(args, info, rows, memcpy)
    result = {
        **result_head("load", args),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "spec": {k: v for k, v in asdict(spec).items() if k != "checkpoint"},
        "world_size": args.world_size,
        **info,
        "memcpy_s": memcpy,
        "rows": rows,
    }
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
