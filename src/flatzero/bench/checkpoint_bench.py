"""Checkpoint benchmark: a verified load against an unverified one, on the same checkpoint.

Every rank builds the model (seed 0) as a ``ZeroOptimizer`` with AdamW at ZeRO stage 2 and
takes one training step (one sequence of ``--seq`` tokens) so that the optimizer holds its
moments; the ranks save one checkpoint (fp32 master and both moments: 12 bytes a param over
the ranks). Then each trial loads it back into the same optimizer with
``LoadConfig(verify=True)`` (every byte read checked against its chunk's crc32c as read)
and with ``verify=False``, alternately (the order rotates every round). The checkpoint is in
the page cache for every trial (written, then re-read each trial): this measures the CPU
and memory work of a load, where a checksum costs the most relative to the rest, not the
disk. Per trial, the slowest rank's wall seconds.
"""

from __future__ import annotations

import argparse
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

from ..checkpoint import LoadConfig, load_checkpoint, save_checkpoint
from ..checkpoint.checksum import DEFAULT_ALGORITHM
from ..config import FlattenConfig
from ..launch import run_ranks
from ..models import build_model, count_params
from ..optim import ZeroOptimizer
from .init_bench import MODELS
from .results import emit, result_head
from .settings import BENCH_DTYPES, TrialsSpec, parse_methods, spec_from_args
from .trials import rotated, slowest_per_trial

__all__ = ["LOAD_METHODS", "CheckpointSpec", "add_arguments", "run"]

LOAD_METHODS = ("verified", "unverified")


@dataclass(frozen=True)
class CheckpointSpec(TrialsSpec):
    """One run's settings (identical on every rank): ``TrialsSpec``'s, and

    Attributes:
        seq: tokens of the training step(s) (one sequence per rank).
        workdir: the directory the checkpoints go to.
    """

    seq: int
    workdir: str


def build(spec: CheckpointSpec) -> tuple[torch.nn.Module, ZeroOptimizer]:
    """The model and its ZeRO-2 AdamW optimizer (no step taken yet)."""
    model = build_model(MODELS[spec.model](), device="cpu", dtype=BENCH_DTYPES[spec.dtype], seed=0)
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=2,
        lr=1e-4,
        flatten_config=FlattenConfig(bucket_numel=spec.bucket_numel, progress=False),
    )
    return model, opt


def train_step(model: torch.nn.Module, opt: ZeroOptimizer, spec: CheckpointSpec, i: int) -> None:
    """One optimizer step on one sequence of random tokens (seeded by step and rank)."""
    g = torch.Generator().manual_seed(1000 * i + opt.rank)
    ids = torch.randint(0, model.config.vocab_size, (1, spec.seq), generator=g)
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _timed_load(path: Path, opt: ZeroOptimizer, verify: bool) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    load_checkpoint(path, opt, config=LoadConfig(verify=verify))
    return time.perf_counter() - t0


def _load_rank(rank: int, world_size: int, spec: CheckpointSpec) -> dict[str, Any]:
    """This rank's load trials: ``{method: [seconds per trial]}`` and bytes saved."""
    torch.manual_seed(0)
    model, opt = build(spec)
    train_step(model, opt, spec, 0)
    path = Path(spec.workdir) / "ckpt"
    save_checkpoint(path, opt, tag="bench")
    mine = path / "bench" / f"rank_{rank:05d}-of-{world_size:05d}.safetensors"
    walls: dict[str, list[float]] = {m: [] for m in spec.methods}
    for round_index in range(spec.warmup + spec.trials):
        for method in rotated(spec.methods, round_index):
            wall = _timed_load(path, opt, verify=method == "verified")
            if round_index >= spec.warmup:
                walls[method].append(wall)
    return {"walls": walls, "file_bytes": os.path.getsize(mine)}


def _load_rows(ranks: list[dict[str, Any]], spec: CheckpointSpec) -> list[dict[str, Any]]:
    rows = []
    for method in spec.methods:
        walls = slowest_per_trial([r["walls"][method] for r in ranks])
        rows.append(
            {"method": method, "wall_s_median": statistics.median(walls), "wall_s_all": walls}
        )
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``flatzero bench checkpoint``."""
    parser.add_argument("--model", default="llama-0.4b", choices=sorted(MODELS))
    parser.add_argument("--dtype", default="bf16", choices=sorted(BENCH_DTYPES))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--methods", default=",".join(LOAD_METHODS))
    parser.add_argument("--bucket-numel", type=int, default=2**24)
    parser.add_argument("--seq", type=int, default=16, help="tokens of a training step")
    parser.add_argument(
        "--workdir", default=None, help="where to write the checkpoints (default: a temp dir)"
    )
    parser.add_argument("--out", default=None, help="write the JSON result to this file")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table and write/print one JSON result."""
    methods = parse_methods(args.methods, LOAD_METHODS)
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        spec = spec_from_args(CheckpointSpec, args, methods=methods, workdir=workdir)
        ranks = run_ranks(_load_rank, args.world_size, spec, timeout_s=3600)
    rows = _load_rows(ranks, spec)
    params = count_params(build_model(MODELS[args.model](), device="meta"))
    ratio = None
    if set(methods) == set(LOAD_METHODS):
        by = {r["method"]: r["wall_s_median"] for r in rows}
        ratio = by["verified"] / by["unverified"]
    print(
        f"model {args.model} ({params / 1e6:.0f}M params), world size {args.world_size}, "
        f"{args.trials} trials, checksum {DEFAULT_ALGORITHM}; "
        f"{sum(r['file_bytes'] for r in ranks) / 2**30:.2f} GiB of rank files"
    )
    for row in rows:
        print(f"{row['method']:<12}{row['wall_s_median']:>8.3f} s")
    if ratio is not None:
        print(f"verified / unverified: {ratio:.3f}x")
    result = {
        **result_head("checkpoint-load", args),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "checksum": DEFAULT_ALGORITHM,
        "spec": {k: v for k, v in asdict(spec).items() if k != "workdir"},
        "world_size": args.world_size,
        "params": params,
        "rank_file_bytes": [r["file_bytes"] for r in ranks],
        "rows": rows,
        "verified_over_unverified": ratio,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
