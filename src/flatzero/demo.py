"""``flatzero demo``: the DeepSpeed door end to end, on this machine.

It prints, in this order (README's list):

1. What is trained: a small Qwen3-MoE-shaped model (the Qwen3-30B-A3B config cut down in
   layers, width and experts; unfused experts, so many small tensors) on 2 ranks spawned
   as ``torchrun`` would (gloo on the CPU).
2. The init report of ``flatzero.initialize`` with a DeepSpeed config.
3. Flattening alone, in process, on fresh copies: each flatten tier that runs here
   (``flatten_parameters``) against DeepSpeed 0.19's whole-group ``torch.cat`` and its
   older CPU path (``flatzero.measure``'s re-implementations of DeepSpeed's flatten).
4. Training (ZeRO-2, gradient accumulation, clipping, a warmup schedule) on bytes of
   Python's own standard library sources, with the loss on a held-out module it never
   trains on: the held-out loss falls from the uniform guess (ln 256 nats per byte) as the
   model learns how Python source reads.
5. A checkpoint saved, reloaded in a fresh world of one rank into a model built with
   another seed, the weights checked to match the trained ones exactly.
6. Door against door: ``flatzero.initialize`` against ``deepspeed.initialize`` (when
   DeepSpeed is installed), each launch a fresh ``torchrun`` job as at a job's start, on
   the tensor count of DeepSpeed issue #7677 (16-layer Qwen3-30B-A3B, unfused experts,
   6,291 tensors, at hidden 64): init, then the first training step, and their ratio
   (``flatzero bench doors`` does this at length).
7. A PNG: the door-to-door headline, the training and held-out loss, and flattening alone
   (labelled: on a CPU every method is a host memory copy).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import textwrap
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .config import FlattenConfig
from .demo_spec import DemoSpec, add_arguments
from .flatten import flatten_parameters
from .harness import find_harness, harness_missing
from .launch import run_ranks
from .models import build_model, count_bytes, count_params, count_tensors

__all__ = ["DemoSpec", "add_arguments", "run", "run_demo"]

TIERS_ON_CPU = ("cpu", "sharded")
"""Flatten tiers that run without a GPU (``sharded`` all-gathers host buckets here)."""
TORCH_CAT = "torch.cat (DeepSpeed 0.19)"
LEGACY = "CPU cat (DeepSpeed <0.19)"


TRAIN_MODULES = ("argparse", "textwrap", "difflib", "calendar", "fractions", "shlex", "ast")
"""Standard library modules whose source is the training text."""
HELD_OUT_MODULE = "statistics"
"""The module whose source is the held-out text (never trained on)."""


def _text(modules: tuple[str, ...], vocab: int) -> torch.Tensor:
    """The bytes of ``modules``' source files, one after another, as token ids."""
    import importlib
    import inspect

    data = b"".join(
        Path(inspect.getsourcefile(importlib.import_module(m)) or "").read_bytes() for m in modules
    )
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long() % vocab


def _windows(text: torch.Tensor, count: int, seq_len: int, seed: int) -> torch.Tensor:
    """``count`` windows of ``seq_len`` tokens at seeded random places of ``text``."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, text.numel() - seq_len, (count,), generator=g)
    return torch.stack([text[s : s + seq_len] for s in starts.tolist()])


def _held_out_loss(engine: Any, held_out: torch.Tensor) -> float:
    """The model's mean loss on ``held_out`` (the same on every rank), without training."""
    engine.eval()
    with torch.no_grad():
        loss = engine(held_out, labels=held_out).loss.item()
    engine.train()
    return loss


def _time_inits(spec: DemoSpec, rank: int, ws: int) -> dict[str, list[float]]:
    """Seconds of each init method on fresh copies of the model, ``trials`` times, each
    starting from the same allocator state, the order rotating between trials."""
    from flatzero_bench.common.trials import rotated

    from .measure.baselines import flatten_legacy_cpu, flatten_torch_cat
    from .procmem import trim_host_memory

    methods = [f"flatzero {t}" for t in TIERS_ON_CPU] + [TORCH_CAT, LEGACY]
    times: dict[str, list[float]] = {m: [] for m in methods}
    for trial in range(1 + spec.trials):  # trial 0 warms up
        for method in rotated(methods, trial):
            model = build_model(spec.model_config(), device="cpu", dtype=torch.float32, seed=0)
            trim_host_memory()  # every method starts from the same allocator state
            dist.barrier()
            t0 = time.perf_counter()
            if method.startswith("flatzero"):
                tier = method.split()[1]
                config = FlattenConfig(tier=tier, bucket_numel=spec.bucket_numel, progress=False)
                result: Any = flatten_parameters(model, config=config)
            else:
                params = [[p for p in model.parameters() if p.requires_grad]]
                baseline = flatten_torch_cat if method == TORCH_CAT else flatten_legacy_cpu
                result = baseline(params, rank=rank, world_size=ws)
            seconds = time.perf_counter() - t0
            if trial > 0:
                times[method].append(seconds)
            del model, result
            trim_host_memory()
    return times


def _train_rank(rank: int, ws: int, spec: DemoSpec) -> dict[str, Any]:
    import flatzero

    times = _time_inits(spec, rank, ws)
    model = build_model(spec.model_config(), device="cpu", dtype=torch.float32, seed=0)
    dist.barrier()
    t0 = time.perf_counter()
    engine, optimizer, _, _ = flatzero.initialize(model=model, config=spec.ds_config())
    times["flatzero.initialize"] = [time.perf_counter() - t0]

    train_text = _text(TRAIN_MODULES, spec.vocab)
    held_out = _windows(_text((HELD_OUT_MODULE,), spec.vocab), spec.held_out, spec.seq_len, 0)
    losses, held = [], [_held_out_loss(engine, held_out)]
    t0 = time.perf_counter()
    for step in range(spec.steps):
        total = 0.0
        for micro in range(spec.grad_accum):
            seed = 1 + (step * spec.grad_accum + micro) * ws + rank  # new bytes every time
            ids = _windows(train_text, spec.micro_batch, spec.seq_len, seed)
            loss = engine(ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            total += loss.item()
        mean = torch.tensor([total / spec.grad_accum])
        dist.all_reduce(mean)
        losses.append(mean.item() / ws)
        held.append(_held_out_loss(engine, held_out))
    train_s = time.perf_counter() - t0

    ckpt = Path(spec.out) / "checkpoint"
    engine.save_checkpoint(ckpt)
    full = optimizer.full_params()
    if rank == 0:
        torch.save(full, Path(spec.out) / "trained_weights.pt")
    return {
        "times": times,
        "losses": losses,
        "held_out": held,
        "train_s": train_s,
        "report": engine.init_report.summary(),
        "tier": "+".join(engine.init_report.tiers),
        "global_steps": engine.global_steps,
    }


def _reload_rank(rank: int, ws: int, spec: DemoSpec) -> dict[str, Any]:
    import flatzero

    model = build_model(spec.model_config(), device="cpu", dtype=torch.float32, seed=99)
    config = {**spec.ds_config(), "train_batch_size": spec.micro_batch * spec.grad_accum}
    engine, optimizer, _, _ = flatzero.initialize(model=model, config=config)
    path, _ = engine.load_checkpoint(Path(spec.out) / "checkpoint")
    trained = torch.load(Path(spec.out) / "trained_weights.pt")
    loaded = optimizer.full_params()
    params = dict(model.named_parameters())
    mismatched = [
        n
        for n, value in trained.items()
        if not torch.equal(loaded[n], value) or not torch.equal(params[n].detach(), value)
    ]
    return {
        "path": path,
        "params": len(trained),
        "mismatched": mismatched,
        "global_steps": engine.global_steps,
    }


def _plot(
    path: Path,
    times: dict[str, float],
    ranks0: dict[str, Any],
    doors: dict[str, Any] | None,
    title: str,
    door_model: str = "",
) -> bool:
    """The demo's picture: door to door (the headline), the losses, flattening alone."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (head, loss, flat) = plt.subplots(1, 3, figsize=(17, 5.4))
    _plot_doors(head, doors, door_model)
    steps = range(1, len(ranks0["losses"]) + 1)
    loss.plot(steps, ranks0["losses"], marker="o", markersize=3, label="training batches")
    loss.plot(range(len(ranks0["held_out"])), ranks0["held_out"], marker="s", markersize=3,
              label=f"held out: {HELD_OUT_MODULE}.py, never trained on")  # fmt: skip
    loss.set_xlabel("optimizer step")
    loss.set_ylabel("loss, nats per byte")
    loss.set_title("training through flatzero.initialize (ZeRO-2)")
    loss.legend()
    names = [n for n in times if n != "flatzero.initialize"]
    colors = ["tab:green" if n.startswith("flatzero") else "tab:gray" for n in names]
    flat.barh(names, [times[n] * 1e3 for n in names], color=colors)
    flat.invert_yaxis()
    caveat = _flatten_caveat(times)
    caveat = textwrap.fill(caveat[0].upper() + caveat[1:] + ".", 70)
    flat.set_xlabel(f"ms (slowest rank, median)\n\n{caveat}", fontsize=8)
    flat.set_title("flattening alone, in process")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _flatten_caveat(times: dict[str, float]) -> str:
    """What the flatten panel cannot show on a CPU, printed and written in the panel (and,
    when a flatzero tier is slower than ``torch.cat`` here, why)."""
    best = min(t for m, t in times.items() if m.startswith("flatzero "))
    slower = best > times[TORCH_CAT]
    return (
        "without a GPU every method is one host memory copy"
        + (", and at this size one torch.cat beats a bucket loop" if slower else "")
        + "; flatzero's gain (one bucket of extra device memory, 1/N of the upload per "
        "rank) needs a GPU: flatzero bench init --device cuda"
    )


def _plot_doors(ax: Any, doors: dict[str, Any] | None, model: str) -> None:
    """The headline panel: init and init + first step, flatzero's door against
    DeepSpeed's, with flatzero / DeepSpeed written over each pair."""
    ax.set_title(f"door to door on {model}\nfresh torchrun launches, slowest rank", fontsize=10)
    if not doors:
        ax.text(0.5, 0.5, "door comparison skipped (--door-trials 0)", ha="center")
        ax.set_axis_off()
        return
    figures = doors["doors"]
    kinds = (("init_s", "initialize"), ("ttfs_s", "initialize + first step"))
    width = 0.38
    for i, (door, color) in enumerate((("flatzero", "tab:green"), ("deepspeed", "tab:gray"))):
        if door not in figures:
            continue
        values = [figures[door][k] for k, _ in kinds]
        xs = [k + (i - 0.5) * width for k in range(len(kinds))]
        ax.bar(xs, values, width, color=color, label=f"{door}.initialize")
    top = max(f[k] for f in figures.values() for k, _ in kinds)
    ratio = doors.get("ratio")
    if ratio is not None:
        for k, (key, _) in enumerate(kinds):
            high = max(figures[d][key] for d in ("flatzero", "deepspeed"))
            ax.text(k, high + top * 0.02, f"flatzero / DeepSpeed\n{ratio[key]:.2f}x",
                    ha="center", va="bottom", fontweight="bold")  # fmt: skip
    ax.set_ylim(0, top * 1.45)
    ax.set_xticks(range(len(kinds)), [label for _, label in kinds])
    ax.set_ylabel("seconds")
    ax.legend(loc="upper center", ncol=2)


def _describe_model(spec: DemoSpec) -> tuple[int, int, int]:
    """Print what is trained; returns its params, tensors and fp32 bytes."""
    meta = build_model(spec.model_config(), device="meta", dtype=torch.float32)
    params, tensors, nbytes = count_params(meta), count_tensors(meta), count_bytes(meta)
    print(
        f"flatzero demo: Qwen3-MoE-shaped model ({spec.layers} layers, hidden {spec.hidden}, "
        f"{spec.experts} unfused experts, vocab {spec.vocab}): {params / 1e6:.1f}M params in "
        f"{tensors} tensors, {nbytes / 2**20:.0f} MiB fp32; {spec.world_size} ranks (gloo, CPU)"
    )
    return params, tensors, nbytes


def _slowest_median(ranks: list[dict[str, Any]]) -> dict[str, float]:
    """Per init method, seconds: the slowest rank per trial, the median over trials."""
    from flatzero_bench.common.trials import slowest_per_trial

    methods = list(ranks[0]["times"])
    return {
        m: statistics.median(slowest_per_trial([r["times"][m] for r in ranks])) for m in methods
    }


def _print_flatten_times(spec: DemoSpec, times: dict[str, float]) -> None:
    """Flattening alone, per tier and method, against DeepSpeed 0.19's ``torch.cat``."""
    print(
        f"flattening alone, in process, same model on {spec.world_size} ranks (median of "
        f"{spec.trials}; flatten_parameters against DeepSpeed's flatten):"
    )
    base = times[TORCH_CAT]
    for m in times:
        if m == "flatzero.initialize":
            continue  # the whole door: compared door to door below
        print(f"  {m:<26} {times[m] * 1e3:8.1f} ms  {times[m] / base:5.2f}x torch.cat")
    caveat = f"({_flatten_caveat(times)})"
    print(textwrap.fill(caveat, 88, initial_indent="  ", subsequent_indent="   "))


def _print_training(spec: DemoSpec, rank0: dict[str, Any]) -> None:
    """The losses, every 5 steps: the training batches' and the held-out text's."""
    losses, held = rank0["losses"], rank0["held_out"]
    print(
        f"\ntraining {spec.steps} steps through flatzero.initialize (ZeRO-2) on the source of "
        f"{len(TRAIN_MODULES)} standard library modules, bytes as tokens; held out: "
        f"{HELD_OUT_MODULE}.py (uniform guess: ln {min(spec.vocab, 256)} = "
        f"{math.log(min(spec.vocab, 256)):.2f}):"
    )
    print(f"  step {0:3d}  {'':>14}  held-out loss {held[0]:.3f}")
    for step in range(spec.steps):
        if step % 5 == 4 or step == spec.steps - 1:
            print(
                f"  step {step + 1:3d}  loss {losses[step]:.3f}  held-out loss {held[step + 1]:.3f}"
            )
    print(
        f"held-out loss {held[0]:.3f} -> {held[-1]:.3f} over {spec.steps} steps "
        f"({rank0['train_s']:.1f} s)"
    )


def _check_reload(spec: DemoSpec, global_steps: int) -> bool:
    """Reload the checkpoint at world size 1 into another model; print whether the weights
    and the global step (``global_steps`` when saved) match."""
    reload = run_ranks(_reload_rank, 1, spec)[0]
    ok = not reload["mismatched"] and reload["global_steps"] == global_steps
    verdict = "match" if ok else f"DIFFER: {reload['mismatched'][:5]}"
    print(
        f"checkpoint {reload['path']} (saved by {spec.world_size} ranks) reloaded at world "
        f"size 1 into a model built with another seed: {reload['params']} params, weights "
        f"{verdict}, global step {reload['global_steps']}"
    )
    return ok


def run_demo(spec: DemoSpec) -> dict[str, Any]:
    """Run the demo, print as it goes; returns the results (also in ``out/demo.json``)."""
    _need_harness()
    t_start = time.perf_counter()
    out = Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "checkpoint", ignore_errors=True)  # a fresh one per run
    params, tensors, nbytes = _describe_model(spec)
    print(
        f"initializing through flatzero.initialize, timing flattening alone and training "
        f"{spec.steps} steps on {spec.world_size} ranks...\n"
    )
    ranks = run_ranks(_train_rank, spec.world_size, spec)
    times = _slowest_median(ranks)
    print(f"{ranks[0]['report']}\n")
    _print_flatten_times(spec, times)
    _print_training(spec, ranks[0])
    ok = _check_reload(spec, ranks[0]["global_steps"])
    doors = _compare_doors(spec) if spec.door_trials > 0 else None
    png = out / "demo.png"
    title = f"flatzero demo: {params / 1e6:.1f}M-param Qwen3-MoE shape, {spec.world_size} ranks"
    plotted = _plot(png, times, ranks[0], doors, title, spec.door_model)
    print(f"plot: {png}" if plotted else "plot: skipped (matplotlib is not installed)")
    result = {
        "spec": asdict(spec),
        "model": {"params": params, "tensors": tensors, "bytes": nbytes},
        "init_seconds": times,
        "losses": ranks[0]["losses"],
        "held_out": ranks[0]["held_out"],
        "reload_ok": ok,
        "doors": doors,
        "plot": str(png) if plotted else None,
        "seconds": time.perf_counter() - t_start,
    }
    with open(out / "demo.json", "w") as f:
        json.dump(result, f, indent=1)
    print(f"done in {result['seconds']:.1f} s")
    return result


def _compare_doors(spec: DemoSpec) -> dict[str, Any]:
    """``flatzero.initialize`` against ``deepspeed.initialize``, fresh launches; printed."""
    from flatzero_bench.doors.doors import compare_back_to_back

    print(
        f"\nflatzero.initialize against deepspeed.initialize on {spec.door_model} "
        f"({spec.world_size} ranks; every launch a fresh torchrun job, slowest rank):"
    )
    figures, skipped = compare_back_to_back(
        spec.door_model, spec.world_size, trials=spec.door_trials
    )
    print(f"  {'door':<22} {'init s':>8} {'first step s':>13} {'init + step s':>14}")
    for door, fig in figures["doors"].items():
        print(
            f"  {door + '.initialize':<22} {fig['init_s']:8.2f} {fig['first_step_s']:13.2f} "
            f"{fig['ttfs_s']:14.2f}"
        )
    ratio = figures["ratio"]
    if ratio is not None:
        print(
            f"  {'flatzero / deepspeed':<22} {ratio['init_s']:7.2f}x "
            f"{ratio['first_step_s']:12.2f}x {ratio['ttfs_s']:13.2f}x"
        )
    for door, why in skipped.items():
        print(f"  {door}: skipped ({why})")
    return figures


def _need_harness() -> None:
    """Make the benchmark harness importable (its trials and door comparison), or raise."""
    if not find_harness():
        raise harness_missing("flatzero demo")


def run(args: argparse.Namespace) -> int:
    """``flatzero demo``: exit status 0 when the reloaded weights match."""
    _need_harness()
    from flatzero_bench.common.settings import spec_from_args

    result = run_demo(spec_from_args(DemoSpec, args, out=os.fspath(args.out)))
    return 0 if result["reload_ok"] else 1
