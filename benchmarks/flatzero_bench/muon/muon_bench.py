"""Muon benchmark: Newton-Schulz work per rank, flatzero's owners against DeepSpeed's ZeRO-2.

The same model (a scaled Llama-3 of real proportions, fp32) trains a few steps at each
world size, with Muon on the hidden matrices and Adam on the rest, split by DeepSpeed's own
rule (2-D and not ``embed``/``lm_head``):

- ``flatzero``: ``ZeroOptimizer(matrices, torch.optim.Muon)`` beside
  ``ZeroOptimizer(rest, torch.optim.AdamW)``, stage 2: each matrix whole on one owner rank
  (``flatzero.owners``), orthogonalized there only;
- ``deepspeed``: ``deepspeed.initialize`` 0.19.8 with its ``Muon`` optimizer config, ZeRO
  stage 2: each rank orthogonalizes the whole gradient of every matrix that touches its
  partition.

Per rank and step the benchmark times every Newton-Schulz call (torch's
``_zeropower_via_newtonschulz``; DeepSpeed's ``muon_update``, which also does its momentum)
and counts them. It reports the slowest rank's seconds per step (what the step waits for),
the mean over ranks, the balance (max / mean), the calls per step over all ranks against
the number of matrices, and the ratio to the same method at world size 1: ideal work per
rank falls as 1/N.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from typing import Any

import torch
from torch import nn

from flatzero import ZeroOptimizer
from flatzero.launch import run_ranks
from flatzero.models import build_model
from flatzero.models.zoo import scaled
from flatzero.testing.deepspeed import without_unavailable_deepspeed
from flatzero_bench.common.machine import cpu_name, versions
from flatzero_bench.common.ranks import threads_per_rank
from flatzero_bench.common.results import emit, print_skipped, result_head

__all__ = ["run"]

LR = 0.02
SEQ = 32


def _config(args: argparse.Namespace):
    return scaled(
        "llama-3-8b",
        layers=args.layers,
        hidden=args.hidden,
        heads=args.hidden // 64,
        kv_heads=max(1, args.hidden // 256),
        head_dim=64,
        intermediate=int(args.hidden * 3.5),
        vocab=args.vocab,
    )


def _uses_muon(name: str, param: nn.Parameter) -> bool:
    """DeepSpeed's rule (``set_optimizer_flags``): matrices other than embeddings/head."""
    return param.ndim >= 2 and not any(k in name.lower() for k in ("embed", "lm_head"))


class _Timer:
    """Wraps a module-level function, adding each call's seconds and count."""

    def __init__(self, module: Any, name: str) -> None:
        self.seconds, self.calls = 0.0, 0
        original = getattr(module, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        setattr(module, name, timed)

    def take(self) -> tuple[float, int]:
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out


def _flatzero(model: nn.Module):
    named = list(model.named_parameters())
    matrices = [p for n, p in named if _uses_muon(n, p)]
    rest = [p for n, p in named if not _uses_muon(n, p)]
    optimizers = [
        ZeroOptimizer(matrices, torch.optim.Muon, stage=2, lr=LR),
        ZeroOptimizer(rest, torch.optim.AdamW, stage=2, lr=1e-3),
    ]
    import torch.optim._muon as muon_module

    timer = _Timer(muon_module, "_zeropower_via_newtonschulz")

    def step(loss: torch.Tensor) -> None:
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()

    return step, timer, len(matrices)


def _deepspeed(model: nn.Module, batch: int):
    from flatzero.testing.deepspeed import prepare_deepspeed

    prepare_deepspeed(warmup=False)
    import deepspeed
    import deepspeed.runtime.zero.muon.original_muon as ds_muon

    config = {
        "train_micro_batch_size_per_gpu": batch,
        "steps_per_print": 2**31 - 1,
        "optimizer": {"type": "Muon", "params": {"lr": LR, "momentum": 0.95}},
        "zero_optimization": {"stage": 2},
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    matrices = sum(1 for n, p in model.named_parameters() if _uses_muon(n, p))
    timer = _Timer(ds_muon, "muon_update")

    def step(loss: torch.Tensor) -> None:
        engine.backward(loss)
        engine.step()

    return step, timer, matrices, engine


def _rank_main(rank: int, world_size: int, method: str, args: argparse.Namespace) -> dict:
    torch.set_num_threads(threads_per_rank(world_size))
    config = _config(args)
    model = build_model(config, device="cpu", dtype=torch.float32, seed=0)
    if method == "flatzero":
        step, timer, matrices = _flatzero(model)
        forward = model
    else:
        step, timer, matrices, engine = _deepspeed(model, args.batch)
        forward = engine
    g = torch.Generator().manual_seed(1000 + rank)
    seconds, calls, losses = [], [], []
    for i in range(args.warmup + args.steps):
        ids = torch.randint(0, config.vocab_size, (args.batch, SEQ), generator=g)
        loss = forward(ids, labels=ids).loss
        step(loss)
        taken, count = timer.take()
        if i >= args.warmup:
            seconds.append(taken)
            calls.append(count)
            losses.append(float(loss.detach()))
    return {
        "seconds": statistics.median(seconds),
        "calls": statistics.median(calls),
        "matrices": matrices,
        "loss": losses[-1],
    }


def run(args: argparse.Namespace) -> None:
    load_before = os.getloadavg()
    methods, skipped = without_unavailable_deepspeed(tuple(args.methods.split(",")))
    print_skipped(skipped)
    rows: list[dict[str, Any]] = []
    base: dict[str, float] = {}
    for world_size in (int(w) for w in args.world_sizes.split(",")):
        for method in methods:
            ranks = run_ranks(_rank_main, world_size, method, args, timeout_s=1800)
            per_rank = [r["seconds"] for r in ranks]
            slowest, mean = max(per_rank), statistics.mean(per_rank)
            base.setdefault(method, slowest)
            rows.append(
                {
                    "method": method,
                    "world_size": world_size,
                    "ns_seconds_slowest_rank": slowest,
                    "ns_seconds_mean_rank": mean,
                    "balance_max_over_mean": slowest / mean if mean else None,
                    "calls_per_step_all_ranks": sum(r["calls"] for r in ranks),
                    "matrices": ranks[0]["matrices"],
                    "slowest_vs_world_size_1": slowest / base[method],
                    "final_loss_rank0": ranks[0]["loss"],
                }
            )
    print(
        f"{'method':<10} {'ranks':>5} {'NS s/step (slowest)':>20} {'mean':>8} {'max/mean':>8} "
        f"{'calls/matrices':>15} {'vs 1 rank':>9}"
    )
    for r in rows:
        print(
            f"{r['method']:<10} {r['world_size']:>5} {r['ns_seconds_slowest_rank']:>20.4f} "
            f"{r['ns_seconds_mean_rank']:>8.4f} {r['balance_max_over_mean'] or 0:>8.2f} "
            f"{r['calls_per_step_all_ranks']:>7.0f}/{r['matrices']:<7} "
            f"{r['slowest_vs_world_size_1']:>9.2f}"
        )
    result = {
        **result_head("muon", args),
        "machine": {"cpu": cpu_name(), **versions()},
        "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "model": dataclasses.asdict(_config(args)),
        "skipped": skipped,
        "rows": rows,
    }
    emit(result, args.out)
