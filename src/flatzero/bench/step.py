"""Step benchmark: ZeroOptimizer's training step against plain AdamW and DeepSpeed ZeRO.

Every method trains its own copy of the same model on the same data, alternately, in one
run and one process tree, with the same optimizer (``torch.optim.AdamW``, lr 1e-4), the
same global-norm clipping (1.0) and the same bucket size:

- ``flatzero-z2`` / ``flatzero-z1``: ``ZeroOptimizer`` stage 2 / stage 1 (which runs
  AdamW's fused kernel over its flat shards by default);
- ``torch-adamw``: plain ``torch.optim.AdamW`` on the model's params with
  ``torch.nn.utils.clip_grad_norm_`` (world size 1 only);
- ``deepspeed-z2`` / ``deepspeed-z1``: ``deepspeed.initialize`` 0.19.8 with a client
  ``torch.optim.AdamW`` (``zero_force_ds_cpu_optimizer: false``), ``engine.backward`` and
  ``engine.step`` (world size > 1, when DeepSpeed is importable);
- ``...-fused``: the same baseline given ``torch.optim.AdamW(fused=True)``, so that the
  comparison does not hinge on flatzero choosing the fused kernel.

Each step is timed in three phases, after a barrier that aligns the ranks:

- ``fwd``: the forward pass and the loss;
- ``bwd``: backward with gradient reduction complete (flatzero: ``loss.backward()`` then
  ``reduce_gradients()``; DeepSpeed: ``engine.backward(loss)``);
- ``step``: clipping, the optimizer step, the parameter all-gather and zeroing the grads.

A step's phase time is the slowest rank's; the table reports the median over the timed
steps, and ratios of each method to the baseline of its world size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import FlattenConfig
from ..devices import local_cuda_index
from ..launch import run_ranks
from ..models import build_model, count_params, scaled
from ..optim import ZeroConfig, ZeroOptimizer
from .provenance import command_line, utc_timestamp

__all__ = ["MODELS", "StepSpec", "add_arguments", "run"]

MODELS = {
    # Seconds per step on a laptop CPU: for tests and smoke runs.
    "tiny": lambda: scaled(
        "llama-3-8b",
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=2,
        head_dim=16,
        intermediate=128,
        vocab=512,
    ),
    # ~22M params, a few hundred ms per step on 2 CPU cores.
    "llama-22m": lambda: scaled(
        "llama-3-8b",
        layers=4,
        hidden=512,
        heads=8,
        kv_heads=4,
        head_dim=64,
        intermediate=1536,
        vocab=8192,
    ),
    # ~0.43B params: the Llama-3-8B shape at 1/4 width and 12 layers (a GPU run).
    "llama-0.4b": lambda: scaled(
        "llama-3-8b", layers=12, hidden=1024, heads=8, kv_heads=2, intermediate=3584
    ),
}
"""Benchmark models by name: functions returning a model config."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
METHODS = ("flatzero-z2", "flatzero-z1", "torch-adamw", "deepspeed-z2", "deepspeed-z1")
LR = 1e-4
MAX_GRAD_NORM = 1.0


@dataclass(frozen=True)
class StepSpec:
    """One benchmark run's settings (identical on every rank).

    Attributes:
        model: a key of ``MODELS``.
        dtype: ``"fp32"`` or ``"bf16"`` (params; masters and optimizer state are fp32,
            except ``torch-adamw`` which keeps everything in the params' dtype).
        methods: the methods to run at this world size, the first one being the baseline.
        batch: sequences per rank and step.
        seq: tokens per sequence.
        warmup: untimed steps per method before timing.
        steps: timed steps per method; the methods alternate step by step.
        bucket_numel: gradient/all-gather bucket size in elements (flatzero and DeepSpeed).
        device: ``"cpu"`` or ``"cuda"``.
    """

    model: str
    dtype: str
    methods: tuple[str, ...]
    batch: int
    seq: int
    warmup: int
    steps: int
    bucket_numel: int
    device: str


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stage(name: str) -> int:
    """``"deepspeed-z2-fused"`` -> 2."""
    return int(name.split("-")[1][1])


def _fused(name: str) -> bool:
    return name.endswith("-fused")


class _Method:
    """A model copy and its optimizer, stepping in three timed phases."""

    def __init__(self, name: str, model: nn.Module, device: torch.device) -> None:
        self.name = name
        self.model = model
        self.device = device
        self.times: list[tuple[float, float, float]] = []
        self.losses: list[float] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, labels=ids).loss

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def train_step(self, ids: torch.Tensor, record: bool) -> None:
        if dist.is_initialized():
            dist.barrier()
        _sync(self.device)
        t0 = time.perf_counter()
        loss = self.forward(ids)
        _sync(self.device)
        t1 = time.perf_counter()
        self.backward(loss)
        _sync(self.device)
        t2 = time.perf_counter()
        self.step()
        _sync(self.device)
        t3 = time.perf_counter()
        if record:
            self.times.append((t1 - t0, t2 - t1, t3 - t2))
            self.losses.append(float(loss.detach()))


class _Flatzero(_Method):
    def __init__(self, name: str, model: nn.Module, device: torch.device, spec: StepSpec):
        super().__init__(name, model, device)
        self.opt = ZeroOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            stage=_stage(name),
            config=ZeroConfig(max_grad_norm=MAX_GRAD_NORM),
            flatten_config=FlattenConfig(
                bucket_numel=spec.bucket_numel, device=str(device), progress=False
            ),
            lr=LR,
        )

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.opt.reduce_gradients()

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()


class _TorchAdamW(_Method):
    def __init__(self, name: str, model: nn.Module, device: torch.device, spec: StepSpec):
        super().__init__(name, model, device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=LR, fused=_fused(name) or None)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, MAX_GRAD_NORM)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class _DeepSpeed(_Method):
    def __init__(self, name: str, model: nn.Module, device: torch.device, spec: StepSpec):
        from .deepspeed_runner import deepspeed_config, prepare_deepspeed

        super().__init__(name, model, device)
        prepare_deepspeed()
        import deepspeed

        config = deepspeed_config(
            stage=_stage(name), dtype=spec.dtype, bucket_numel=spec.bucket_numel
        )
        config["gradient_clipping"] = MAX_GRAD_NORM
        config["train_micro_batch_size_per_gpu"] = spec.batch
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=_fused(name) or None)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.engine(ids, labels=ids).loss

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()


_KINDS: dict[str, type[_Method]] = {
    "flatzero": _Flatzero,
    "torch": _TorchAdamW,
    "deepspeed": _DeepSpeed,
}


def _device(spec: StepSpec, rank: int) -> torch.device:
    if spec.device == "cuda":
        return torch.device("cuda", local_cuda_index())
    return torch.device("cpu")


def _threads(world_size: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world_size)


def _rank_main(rank: int, world_size: int, spec: StepSpec) -> dict[str, Any]:
    device = _device(spec, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(_threads(world_size))
    config = MODELS[spec.model]()
    pristine = build_model(config, device="cpu", dtype=DTYPES[spec.dtype], seed=0)
    state = {k: v.detach().clone() for k, v in pristine.state_dict().items()}
    n_params = count_params(pristine)
    del pristine

    methods: list[_Method] = []
    for name in spec.methods:
        model = build_model(config, device="meta", dtype=DTYPES[spec.dtype])
        model.to_empty(device=device)
        model.load_state_dict(state)
        methods.append(_KINDS[name.split("-")[0]](name, model, device, spec))
    del state

    g = torch.Generator().manual_seed(1000 + rank)
    total = spec.warmup + spec.steps
    data = [
        torch.randint(0, config.vocab_size, (spec.batch, spec.seq), generator=g).to(device)
        for _ in range(total)
    ]
    cursor = dict.fromkeys(spec.methods, 0)

    def run_steps(method: _Method, count: int, record: bool) -> None:
        for _ in range(count):
            method.train_step(data[cursor[method.name]], record)
            cursor[method.name] += 1

    for method in methods:
        run_steps(method, spec.warmup, record=False)
    # Alternate step by step (reversing the order every other step), so that any drift in
    # the machine's load hits every method alike.
    for i in range(spec.steps):
        for method in methods if i % 2 == 0 else methods[::-1]:
            run_steps(method, 1, record=True)
    return {
        "params": n_params,
        "threads": torch.get_num_threads(),
        "times": {m.name: m.times for m in methods},
        "losses": {m.name: m.losses for m in methods},
    }


def _baselines_of(method: str, world_size: int) -> tuple[str, str]:
    """What ``method`` is compared with: (default, fused) plain AdamW at world size 1,
    else (default, fused) DeepSpeed at the same stage."""
    if world_size == 1:
        return "torch-adamw", "torch-adamw-fused"
    stage = _stage(method)
    return f"deepspeed-z{stage}", f"deepspeed-z{stage}-fused"


def _summarize(world_size: int, ranks: list[dict[str, Any]], spec: StepSpec) -> list[dict]:
    """Per method: median over steps of the slowest rank's phase times, and ratios."""
    rows = []
    for name in spec.methods:
        per_step = [
            tuple(max(r["times"][name][i][k] for r in ranks) for k in range(3))
            for i in range(len(ranks[0]["times"][name]))
        ]
        fwd, bwd, step = (statistics.median(s[k] for s in per_step) for k in range(3))
        total = statistics.median(sum(s) for s in per_step)
        rows.append(
            {
                "world_size": world_size,
                "method": name,
                "fwd_s": fwd,
                "bwd_s": bwd,
                "step_s": step,
                "bwd_plus_step_s": statistics.median(s[1] + s[2] for s in per_step),
                "total_s": total,
                "final_loss": ranks[0]["losses"][name][-1],
                "timed_steps": len(per_step),
            }
        )
    by_name = {row["method"]: row for row in rows}
    for row in rows:
        row["ratios"] = {
            base: {
                key[:-2]: row[key] / by_name[base][key]
                for key in ("bwd_s", "step_s", "bwd_plus_step_s", "total_s")
            }
            for base in _baselines_of(row["method"], world_size)
            if base in by_name
        }
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| world size | method | fwd ms | bwd+reduce ms | step ms | bwd+step ms | total ms "
        "| bwd+step / baseline | total / baseline |",
        "|---:|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        ratios = row["ratios"].items()
        lines.append(
            f"| {row['world_size']} | {row['method']} | {row['fwd_s'] * 1e3:.1f} | "
            f"{row['bwd_s'] * 1e3:.1f} | {row['step_s'] * 1e3:.1f} | "
            f"{row['bwd_plus_step_s'] * 1e3:.1f} | {row['total_s'] * 1e3:.1f} | "
            + "<br>".join(f"{r['bwd_plus_step']:.3f}x {b}" for b, r in ratios)
            + " | "
            + "<br>".join(f"{r['total']:.3f}x {b}" for b, r in ratios)
            + " |"
        )
    return "\n".join(lines)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _versions() -> dict[str, str]:
    out = {"torch": torch.__version__}
    try:
        from importlib.metadata import version

        out["deepspeed"] = version("deepspeed")
    except Exception:  # not installed
        pass
    return out


def _methods_for(
    world_size: int, stages: Sequence[int], deepspeed: bool, fused: bool
) -> tuple[str, ...]:
    ours = tuple(f"flatzero-z{s}" for s in stages)
    variants = ("", "-fused") if fused else ("",)
    if world_size == 1:
        return (*ours, *(f"torch-adamw{v}" for v in variants))
    if not deepspeed:
        return ours
    return (*ours, *(f"deepspeed-z{s}{v}" for s in stages for v in variants))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``flatzero bench step`` options."""
    parser.add_argument("--model", default="llama-22m", choices=sorted(MODELS))
    parser.add_argument("--dtypes", default="fp32", help="comma-separated of fp32, bf16")
    parser.add_argument("--world-sizes", default="1,2", help="comma-separated, e.g. 1,2")
    parser.add_argument("--stages", default="2", help="ZeRO stages to compare, e.g. 1,2")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per method")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per method")
    parser.add_argument(
        "--bucket-numel", type=int, default=2**22, help="reduce/all-gather bucket elements"
    )
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"]
    )
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed")
    parser.add_argument(
        "--no-fused-baselines",
        action="store_true",
        help="skip the baselines with torch's fused AdamW (flatzero uses it by default)",
    )
    parser.add_argument("--json", help="also write the result JSON to this path")
    parser.add_argument("--markdown", help="also write the table (markdown) to this path")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table and one JSON line."""
    from .deepspeed_runner import deepspeed_available

    stages = tuple(int(s) for s in args.stages.split(","))
    if any(s not in (1, 2) for s in stages):
        raise SystemExit(f"--stages must list 1 and/or 2, got {args.stages!r}")
    dtypes = tuple(d for d in args.dtypes.split(",") if d)
    if any(d not in DTYPES for d in dtypes):
        raise SystemExit(f"--dtypes must list fp32 and/or bf16, got {args.dtypes!r}")
    skipped: dict[str, str] = {}
    use_ds = not args.no_deepspeed
    if use_ds:
        use_ds, why = deepspeed_available()
        if not use_ds:
            skipped["deepspeed"] = why
    backend = "nccl" if args.device == "cuda" else "gloo"
    rows, specs, info = [], [], {}
    load_before = os.getloadavg()
    for dtype in dtypes:
        for ws in (int(w) for w in args.world_sizes.split(",")):
            spec = StepSpec(
                model=args.model,
                dtype=dtype,
                methods=_methods_for(ws, stages, use_ds, not args.no_fused_baselines),
                batch=args.batch,
                seq=args.seq,
                warmup=args.warmup,
                steps=args.steps,
                bucket_numel=args.bucket_numel,
                device=args.device,
            )
            env = {"DS_ACCELERATOR": "cpu"} if args.device == "cpu" else None
            ranks = run_ranks(_rank_main, ws, spec, backend=backend, env=env, timeout_s=3600)
            done = [{"dtype": dtype, **row} for row in _summarize(ws, ranks, spec)]
            rows.extend(done)
            specs.append(asdict(spec))
            print(f"dtype {dtype}, world size {ws}:\n{_table(done)}\n", flush=True)
            info = {"params": ranks[0]["params"], "threads_per_rank": ranks[0]["threads"]}
    load_after = os.getloadavg()
    device = torch.cuda.get_device_name() if args.device == "cuda" else _cpu_name()
    versions = _versions()
    header = (
        f"model {args.model}: {info['params'] / 1e6:.1f}M params; batch {args.batch} x "
        f"{args.seq} tokens per rank; {platform.node()}: {os.cpu_count()} cpus, {device}; "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + f"; 1-min load average {load_before[0]:.1f} before, {load_after[0]:.1f} after"
    )
    print(header)
    for method, why in skipped.items():
        print(f"skipped {method}: {why}")
    table = "\n\n".join(
        f"dtype {dtype}:\n\n" + _table([r for r in rows if r["dtype"] == dtype]) for dtype in dtypes
    )
    print(table)
    result = {
        "benchmark": "step",
        "command": command_line(args),
        "date": utc_timestamp(),
        "machine": {
            "node": platform.node(),
            "cpus": os.cpu_count(),
            "device": device,
            "load_average_before": load_before,
            "load_average_after": load_after,
            **versions,
        },
        "model": {"name": args.model, **info},
        "specs": specs,
        "rows": rows,
        "skipped": skipped,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(
                f"# flatzero bench step, {result['date']}\n\n"
                f"Command: `{result['command']}`\n\n{header}\n\n"
                f"Each phase: the slowest rank's time, median over {args.steps} timed steps per "
                "method (methods alternate step by step). bwd+reduce: backward with the "
                "gradient reduction complete; step: clipping, optimizer step, parameter "
                "all-gather, zeroing.\n\n"
                f"{table}\n"
            )
    print(json.dumps(result))
    return 0
