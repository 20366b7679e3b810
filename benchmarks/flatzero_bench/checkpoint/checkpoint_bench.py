"""Checkpoint benchmark: verified against unverified loads; step time lost to a save.

Every rank builds the model (seed 0) as a ``ZeroOptimizer`` with AdamW at ZeRO stage 2 and
takes one training step (one sequence of ``--seq`` tokens) so that the optimizer holds its
moments (fp32 master and both moments: 12 bytes a param over the ranks).

``--what load``: the ranks save one checkpoint; each trial loads it back into the same
optimizer with ``LoadConfig(verify=True)`` (every byte read checked against its chunk's
crc32c as read) and with ``verify=False``, alternately (the order rotates every round). The
checkpoint is in the page cache for every trial: this measures the CPU and memory work of a
load, where a checksum costs the most relative to the rest, not the disk.

``--what save``: the step time a save costs training. A window is a save, ``--steps``
training steps, and the wait until the save is complete; every round also runs a window
without a save (``none``), and a method's lost time in a round is its window minus the
mean of the ``none`` windows over every round (of its block, below); each step's seconds
are recorded too (``steps_s_all``). After every window, untimed, dirty pages are written
back (``os.sync``), so that a save's writeback lands in its own window or nowhere, never
in the next. Give it enough steps to cover a background
write (a real run saves every hundreds of steps): with fewer, the wait at the window's
end counts as lost. Methods: ``sync`` (``save_checkpoint``), ``async``
(``asynchronous=True``: a copy into host memory, a background thread writes), rotating in
every round with ``none``; then ``dcp_async`` (``torch.distributed.checkpoint.async_save``
of the same tensors: each rank's master and moment shards under names of its own, on a
gloo group of its own), rotating with ``none`` windows of its own, after flatzero's host
copy is freed (so that no two host copies are held at once).

Per window, the slowest rank's seconds; medians over rounds (after ``--warmup`` rounds).

``--what writer``: where a save's time goes, without training steps: per method (``sync``,
``async``, ``async_buffered``: the same with the snapshot written through the page cache,
``image.DIRECT = False``) ``--trials`` saves in a row (the first asynchronous one allocates
and first touches its host buffer), each timed for the call (wall and CPU seconds of the
process) and, for the asynchronous ones, for the background write while the main thread
only waits (its CPU seconds are the writer thread's).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from flatzero.checkpoint import LoadConfig, SaveConfig, load_checkpoint, save_checkpoint
from flatzero.checkpoint.checkpointer import release_snapshot, wait_for_save
from flatzero.config import FlattenConfig
from flatzero.launch import run_ranks
from flatzero.models import build_model, count_params
from flatzero.optim import ZeroOptimizer
from flatzero.storage import image
from flatzero.storage.checksum import DEFAULT_ALGORITHM
from flatzero_bench.checkpoint.options import (
    LOAD_METHODS,
    SAVE_METHODS,
    WRITER_METHODS,
    add_arguments,
)
from flatzero_bench.common.results import emit, result_head
from flatzero_bench.common.settings import BENCH_DTYPES, TrialsSpec, parse_methods, spec_from_args
from flatzero_bench.common.trials import bracketed, median_interval, rotated, slowest_per_trial
from flatzero_bench.init.init_bench import MODELS

__all__ = ["LOAD_METHODS", "SAVE_METHODS", "CheckpointSpec", "add_arguments", "run"]


@dataclass(frozen=True)
class CheckpointSpec(TrialsSpec):
    """One run's settings (identical on every rank): ``TrialsSpec``'s, and

    Attributes:
        seq: tokens of the training step(s) (one sequence per rank).
        steps: training steps timed after each save (``--what save``).
        workdir: the directory the checkpoints go to.
    """

    seq: int
    steps: int
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


def _timed_load(path: Path, opt: ZeroOptimizer, verify: bool) -> tuple[float, float]:
    """Wall and CPU seconds (all threads of this process) of one load."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    load_checkpoint(path, opt, config=LoadConfig(verify=verify))
    return time.perf_counter() - t0, time.process_time() - c0


def _load_rank(rank: int, world_size: int, spec: CheckpointSpec) -> dict[str, Any]:
    """This rank's load trials: ``{method: [seconds per trial]}`` and bytes saved."""
    torch.manual_seed(0)
    model, opt = build(spec)
    train_step(model, opt, spec, 0)
    path = Path(spec.workdir) / "ckpt"
    save_checkpoint(path, opt, tag="bench")
    mine = path / "bench" / f"rank_{rank:05d}-of-{world_size:05d}.safetensors"
    walls: dict[str, list[float]] = {m: [] for m in spec.methods}
    cpus: dict[str, list[float]] = {m: [] for m in spec.methods}
    for round_index in range(spec.warmup + spec.trials):
        for method in rotated(spec.methods, round_index):
            wall, cpu = _timed_load(path, opt, verify=method == "verified")
            if round_index >= spec.warmup:
                walls[method].append(wall)
                cpus[method].append(cpu)
    return {"walls": walls, "cpus": cpus, "file_bytes": os.path.getsize(mine)}


def _load_rows(ranks: list[dict[str, Any]], spec: CheckpointSpec) -> list[dict[str, Any]]:
    rows = []
    for method in spec.methods:
        walls = slowest_per_trial([r["walls"][method] for r in ranks])
        cpus = [c for r in ranks for c in r["cpus"][method]]
        rows.append(
            {
                "method": method,
                "wall_s_median": statistics.median(walls),
                "wall_s_min": min(walls),
                "cpu_s_median_per_rank": statistics.median(cpus),
                "wall_s_all": walls,
            }
        )
    return rows


def _dcp_state(opt: ZeroOptimizer) -> dict[str, torch.Tensor]:
    """What ``save_checkpoint`` writes of this rank, under names of its own (DCP writes
    each key once over all ranks)."""
    groups = opt.sharded_state().groups
    state = {}
    for gi, group in enumerate(groups):
        state[f"rank{opt.rank}.g{gi}.master"] = group.master
        state |= {f"rank{opt.rank}.g{gi}.{k}": v for k, v in group.shards.items()}
    return state


def _start_save(method: str, path: Path, opt: ZeroOptimizer, index: int, group: Any) -> Any:
    """Start a save by ``method``; returns what ``_finish_save`` waits on. DCP's runs its
    collectives on ``group``, a gloo group of its own (its background thread's collectives
    would otherwise interleave with training's, as torch's documentation warns)."""
    if method == "dcp_async":
        import torch.distributed.checkpoint as dcp

        return dcp.async_save(
            _dcp_state(opt), checkpoint_id=str(path / f"dcp{index}"), process_group=group
        )
    config = SaveConfig(overwrite=True, keep_last=1)
    save_checkpoint(path, opt, f"bench{index}", config=config, asynchronous=method == "async")
    return None


def _finish_save(method: str, opt: ZeroOptimizer, handle: Any) -> None:
    if method == "dcp_async":
        handle.result()
    elif method == "async":
        wait_for_save(opt)


def _timed_steps(model: torch.nn.Module, opt: ZeroOptimizer, spec: CheckpointSpec) -> list[float]:
    """``spec.steps`` training steps; the wall seconds of each."""
    seconds = []
    for i in range(spec.steps):
        t0 = time.perf_counter()
        train_step(model, opt, spec, i)
        seconds.append(time.perf_counter() - t0)
    return seconds


def _window(
    method: str,
    path: Path,
    model: torch.nn.Module,
    opt: ZeroOptimizer,
    spec: CheckpointSpec,
    index: int,
    group: Any,
) -> dict[str, float]:
    """One trial: a save by ``method`` (``none``: no save), ``spec.steps`` steps, the wait
    for the save; the seconds the call blocked, each step's and the wall seconds of it all.
    Then, untimed, the kernel writes back every dirty page (``os.sync``) and the ranks
    meet, so that no window's writeback runs into the next one."""
    dist.barrier()
    t0 = time.perf_counter()
    handle = None if method == "none" else _start_save(method, path, opt, index, group)
    call = time.perf_counter() - t0
    steps = _timed_steps(model, opt, spec)
    if method != "none":
        _finish_save(method, opt, handle)
    wall = time.perf_counter() - t0
    os.sync()
    dist.barrier()
    return {"call_s": call, "wall_s": wall, "step_s": steps}


def _save_rank(rank: int, world_size: int, spec: CheckpointSpec) -> dict[str, Any]:
    """Per round and method (``none`` included: the same steps without a save), the
    seconds the save call blocked and the wall seconds of the save, ``spec.steps`` steps
    and the wait for the save. flatzero's methods rotate in every round; DCP's, with
    ``none`` windows of their own, run after them, once flatzero's host copy is freed."""
    torch.manual_seed(0)
    model, opt = build(spec)
    train_step(model, opt, spec, 0)
    path = Path(spec.workdir) / "ckpt"
    dcp_group = dist.new_group(backend="gloo")
    ours = ["none", *(m for m in spec.methods if m != "dcp_async")]
    blocks = [ours] + ([["none", "dcp_async"]] if "dcp_async" in spec.methods else [])
    trials: dict[str, list[dict[str, float]]] = {}
    index = 0
    for block, methods in enumerate(blocks):
        for round_index in range(spec.warmup + spec.trials):
            for method in rotated(methods, round_index):
                window = _window(method, path, model, opt, spec, index, dcp_group)
                window["order"] = index
                index += 1
                kind = "" if round_index >= spec.warmup else "warmup:"
                trials.setdefault(f"{kind}{method}@{block}", []).append(window)
        release_snapshot(opt)
        dist.barrier()
        if rank == 0:
            for old in path.glob("dcp*"):
                shutil.rmtree(old)
    return {"trials": trials}


def _writer_rank(rank: int, world_size: int, spec: CheckpointSpec) -> dict[str, Any]:
    """Per method and save: the call's and the background write's wall and CPU seconds."""
    torch.manual_seed(0)
    model, opt = build(spec)
    train_step(model, opt, spec, 0)
    path = Path(spec.workdir) / "ckpt"
    config = SaveConfig(overwrite=True, keep_last=1)
    saves: dict[str, list[dict[str, float]]] = {}
    for index, method in enumerate(m for m in spec.methods for _ in range(spec.trials)):
        dist.barrier()
        image.DIRECT = method != "async_buffered"
        t0, c0 = time.perf_counter(), time.process_time()
        save_checkpoint(path, opt, f"w{index}", config=config, asynchronous=method != "sync")
        t1, c1 = time.perf_counter(), time.process_time()
        wait_for_save(opt)
        t2, c2 = time.perf_counter(), time.process_time()
        saves.setdefault(method, []).append(
            {"call_s": t1 - t0, "call_cpu_s": c1 - c0, "write_s": t2 - t1, "write_cpu_s": c2 - c1}
        )
    image.DIRECT = True
    release_snapshot(opt)
    return {"saves": saves}


def _report_writer(args: argparse.Namespace, spec: CheckpointSpec, ranks: list[dict]) -> dict:
    result = {**_head(args, spec, ranks), "saves": [r["saves"] for r in ranks]}
    print(f"model {args.model}, world size {args.world_size}; rank 0, save by save:")
    print(f"{'method':<16}{'#':>3}{'call s':>9}{'call cpu':>10}{'write s':>9}{'write cpu':>11}")
    for method, saves in ranks[0]["saves"].items():
        for i, t in enumerate(saves):
            print(
                f"{method:<16}{i:>3}{t['call_s']:>9.2f}{t['call_cpu_s']:>10.2f}"
                f"{t['write_s']:>9.2f}{t['write_cpu_s']:>11.2f}"
            )
    return result


def _save_rows(ranks: list[dict[str, Any]], spec: CheckpointSpec) -> dict[str, Any]:
    """Per method, the slowest rank's: the median over rounds of (its window - the mean
    window without a save), of (its window - the same round's window without a save) and
    of (its window - the mean of the windows without a save right before and after it,
    with a distribution-free interval for that median); and the blocking time of the
    call."""

    def slowest(key: str, field: str) -> list[float]:
        return slowest_per_trial([[t[field] for t in r["trials"][key]] for r in ranks])

    def slowest_steps(key: str) -> list[list[float]]:
        """Per round, per step: the slowest rank's seconds."""
        rounds = zip(*([t["step_s"] for t in r["trials"][key]] for r in ranks), strict=True)
        return [[max(s) for s in zip(*per_rank, strict=True)] for per_rank in rounds]

    def lost(key: str, block: str, kind: str = "") -> tuple[list[float], list[float]]:
        """Per round: the window minus the mean of the block's windows without a save
        (a mean over every round, not one round's: as noisy as one window, not two; each
        window's own steps are no baseline: on the development VM a run's steps switch
        between speeds, 0.45 and 0.6 s, for minutes at a time)."""
        walls, base = slowest(kind + key, "wall_s"), slowest(f"none@{block}", "wall_s")
        mean = statistics.fmean(base)
        return [w - mean for w in walls], base

    def order(key: str) -> list[int]:
        """The run order of the windows of ``key`` (the same on every rank)."""
        return [int(t["order"]) for t in ranks[0]["trials"][key]]

    def baseline(block: str) -> dict[int, float]:
        """The block's windows without a save: run order -> the slowest rank's seconds."""
        return dict(zip(order(f"none@{block}"), slowest(f"none@{block}", "wall_s"), strict=True))

    rows = []
    steps = []
    for key in ranks[0]["trials"]:
        if key.startswith("warmup:"):
            continue
        method, block = key.split("@")
        if method == "none":
            continue
        lost_s, base = lost(key, block)
        steps += [b / spec.steps for b in base]
        walls = slowest(key, "wall_s")
        paired = [w - b for w, b in zip(walls, base, strict=True)]
        around = bracketed(order(key), walls, baseline(block))
        low, high, coverage = median_interval(around)
        row = {
            "method": method,
            "call_s_median": statistics.median(slowest(key, "call_s")),
            "lost_s_median": statistics.median(lost_s),
            # against the same round's window without a save (adjacent in time: slow drift
            # cancels, one window's noise more counts): a second view, reported beside
            "lost_paired_s_median": statistics.median(paired),
            "lost_paired_s_all": paired,
            # against the windows without a save right before and after it, interpolated
            # (drift cancels to first order): the estimate judged on, with an interval
            "lost_bracketed_s_median": statistics.median(around),
            "lost_bracketed_s_interval": [low, high],
            "lost_bracketed_interval_coverage": coverage,
            "lost_bracketed_s_all": around,
            "order_all": order(key),
            "no_save_order_all": order(f"none@{block}"),
            "lost_s_min": min(lost_s),
            "lost_s_all": lost_s,
            "call_s_all": slowest(key, "call_s"),
            "wall_s_all": walls,
            "no_save_wall_s_all": base,
            "steps_s_all": slowest_steps(key),
        }
        if "warmup:" + key in ranks[0]["trials"]:  # the first save: buffers not yet touched
            row["warmup_lost_s"] = lost(key, block, "warmup:")[0]
            row["warmup_call_s"] = slowest("warmup:" + key, "call_s")
        rows.append(row)
    rows.sort(key=lambda r: spec.methods.index(r["method"]))
    by = {r["method"]: r for r in rows}
    sync = by.get("sync")
    for row in rows:
        row["lost_vs_sync"] = row["lost_s_median"] / sync["lost_s_median"] if sync else None
        row["lost_vs_sync_call"] = row["lost_s_median"] / sync["call_s_median"] if sync else None
        row["lost_paired_vs_sync"] = (
            row["lost_paired_s_median"] / sync["lost_paired_s_median"] if sync else None
        )
        # this method's median and its interval over the synchronous save's median (a
        # point: the ratio's interval holds this method's uncertainty, not sync's)
        sync_lost = sync["lost_bracketed_s_median"] if sync else None
        usable = sync_lost is not None and sync_lost > 0
        ratios = [x / sync_lost for x in row["lost_bracketed_s_interval"]] if usable else None
        median = row["lost_bracketed_s_median"]
        row["lost_bracketed_vs_sync"] = median / sync_lost if usable else None
        row["lost_bracketed_vs_sync_interval"] = ratios
    return {"step_s_median": statistics.median(steps), "rows": rows}


def _head(args: argparse.Namespace, spec: CheckpointSpec, ranks: list[dict]) -> dict[str, Any]:
    params = count_params(build_model(MODELS[args.model](), device="meta"))
    return {
        **result_head(f"checkpoint-{args.what}", args),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "checksum": DEFAULT_ALGORITHM,
        "loadavg_at_start": getattr(args, "loadavg_at_start", None),
        "loadavg_at_end": os.getloadavg(),
        "spec": {k: v for k, v in asdict(spec).items() if k != "workdir"},
        "world_size": args.world_size,
        "params": params,
    }


def _report_load(args: argparse.Namespace, spec: CheckpointSpec, ranks: list[dict]) -> dict:
    rows = _load_rows(ranks, spec)
    result = {**_head(args, spec, ranks), "rank_file_bytes": [r["file_bytes"] for r in ranks]}
    by = {r["method"]: r for r in rows}
    ratio = None
    if set(by) == set(LOAD_METHODS):
        ratio = {
            key: by["verified"][key] / by["unverified"][key]
            for key in ("wall_s_median", "wall_s_min", "cpu_s_median_per_rank")
        }
    print(
        f"model {args.model} ({result['params'] / 1e6:.0f}M params), world size "
        f"{args.world_size}, {args.trials} trials, checksum {DEFAULT_ALGORITHM}; "
        f"{sum(result['rank_file_bytes']) / 2**30:.2f} GiB of rank files"
    )
    print(f"{'method':<12}{'wall s (median)':>16}{'wall s (min)':>14}{'cpu s/rank':>12}")
    for row in rows:
        print(
            f"{row['method']:<12}{row['wall_s_median']:>16.3f}{row['wall_s_min']:>14.3f}"
            f"{row['cpu_s_median_per_rank']:>12.3f}"
        )
    if ratio is not None:
        print("verified / unverified: " + ", ".join(f"{k} {v:.3f}x" for k, v in ratio.items()))
    return {**result, "rows": rows, "verified_over_unverified": ratio}


def _report_save(args: argparse.Namespace, spec: CheckpointSpec, ranks: list[dict]) -> dict:
    summary = _save_rows(ranks, spec)
    result = {**_head(args, spec, ranks), **summary}
    print(
        f"model {args.model} ({result['params'] / 1e6:.0f}M params), world size "
        f"{args.world_size}, {args.trials} trials; step {summary['step_s_median']:.3f} s"
    )
    print(
        f"{'method':<12}{'call s':>8}{'lost s':>8}{'/ sync':>8}{'paired s':>10}{'/ sync':>8}"
        f"{'bracketed s [interval]':>26}{'/ sync [interval]':>22}{'first save lost s':>19}"
    )
    for row in summary["rows"]:
        lost, paired, around = (
            "" if row[k] is None else f"{row[k]:.3f}"
            for k in ("lost_vs_sync", "lost_paired_vs_sync", "lost_bracketed_vs_sync")
        )
        low, high = row["lost_bracketed_s_interval"]
        median = f"{row['lost_bracketed_s_median']:.3f} [{low:.3f}, {high:.3f}]"
        ratios = row["lost_bracketed_vs_sync_interval"]
        around += "" if ratios is None else f" [{ratios[0]:.3f}, {ratios[1]:.3f}]"
        first = ", ".join(f"{x:.2f}" for x in row.get("warmup_lost_s", []))
        print(
            f"{row['method']:<12}{row['call_s_median']:>8.3f}{row['lost_s_median']:>8.3f}"
            f"{lost:>8}{row['lost_paired_s_median']:>10.3f}{paired:>8}"
            f"{median:>26}"
            f"{around:>22}{first:>19}"
        )
    coverage = min((r["lost_bracketed_interval_coverage"] for r in summary["rows"]), default=0)
    print(
        "lost: the window (save, steps, wait) minus the mean window without a save; paired: "
        "minus the same round's; bracketed: minus the windows without a save right before "
        f"and after it, interpolated, [a {coverage:.0%} interval for its median]; medians "
        "over rounds; / sync: over the synchronous save's median"
    )
    return result


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table and write/print one JSON result."""
    known = {"load": LOAD_METHODS, "save": SAVE_METHODS, "writer": WRITER_METHODS}[args.what]
    methods = parse_methods(args.methods or ",".join(known), known)
    main = {"load": _load_rank, "save": _save_rank, "writer": _writer_rank}[args.what]
    args.loadavg_at_start = os.getloadavg()  # other jobs on the machine, for the record
    if args.workdir is not None:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        spec = spec_from_args(CheckpointSpec, args, methods=methods, workdir=workdir)
        ranks = run_ranks(main, args.world_size, spec, timeout_s=3600)
    report = {"load": _report_load, "save": _report_save, "writer": _report_writer}[args.what]
    result = report(args, spec, ranks)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
