"""``flatzero bench offload --what step``: whole training steps with optimizer offload,
flatzero's engine against DeepSpeed's, alternating step by step in one launch of ranks.

Every method trains its own copy of the same model (bf16, on the host; gloo, DeepSpeed on
its CPU accelerator) on the same batches, through ``initialize`` with the same DeepSpeed
config (``offload_trial.offload_config``: ZeRO stage, bf16, clipping 1.0, an ``optimizer``
section with AdamW, ``offload_optimizer: {device: cpu, pin_memory: true}``):

- ``flatzero-offload``: ``flatzero.initialize`` (its host step: torch's fused CPU AdamW);
- ``deepspeed-offload``: ``deepspeed.initialize``, which builds ``DeepSpeedCPUAdam`` from
  the ``optimizer`` section under offload (its ``cpu_adam`` op, JIT-built once);
- ``deepspeed-offload-torch``: the same DeepSpeed config without the ``optimizer`` section,
  given a client ``torch.optim.AdamW(fused=True)`` (``zero_force_ds_cpu_optimizer: false``
  lets DeepSpeed accept it under offload), for context;
- ``flatzero``: flatzero without offload, for context (on a machine without an
  accelerator offload changes little: everything is in host memory already).

Each step is timed in three phases after a barrier (``step_methods.StepMethod``): forward,
backward (``engine.backward``: gradients reduced, and with offload on their way to the
host) and ``engine.step()`` (clipping, the host step, the upload, the all-gather). Per step
the slowest rank counts; the table gives medians over the timed steps.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flatzero_bench.common.ranks import threads_per_rank
from flatzero_bench.common.settings import BENCH_DTYPES
from flatzero_bench.offload.offload_trial import ADAMW, offload_config
from flatzero_bench.step.step_methods import StepMethod

__all__ = ["BASELINE", "OffloadStepSpec", "rank_main", "summarize"]

BASELINE = "deepspeed-offload"


@dataclass(frozen=True)
class OffloadStepSpec:
    """One launch's settings (identical on every rank).

    Attributes:
        model: a key of ``models.bench_models.STEP_MODELS``.
        dtype: the params' dtype, ``"bf16"`` or ``"fp32"``.
        methods: of ``options.STEP_METHODS``.
        stage: ZeRO stage.
        batch: sequences per rank and step.
        seq: tokens per sequence.
        warmup: untimed steps per method first.
        steps: timed steps per method (alternating).
        bucket_numel: reduce and all-gather bucket sizes, elements.
        communication_data_type: the config's ``communication_data_type`` (both doors);
            None: unset (both doors then reduce bf16 gradients in bf16).
    """

    model: str
    dtype: str
    methods: tuple[str, ...]
    stage: int
    batch: int
    seq: int
    warmup: int
    steps: int
    bucket_numel: int
    communication_data_type: str | None = None


class _Engine(StepMethod):
    """A door's engine over one model copy."""

    def __init__(self, name: str, model: nn.Module, spec: OffloadStepSpec) -> None:
        super().__init__(name, model, torch.device("cpu"))
        config = offload_config(
            stage=spec.stage,
            bucket_numel=spec.bucket_numel,
            dtype=spec.dtype,
            offload=name != "flatzero",
        )
        config["train_micro_batch_size_per_gpu"] = spec.batch
        if spec.communication_data_type is not None:
            config["communication_data_type"] = spec.communication_data_type
        if name.startswith("deepspeed"):
            from flatzero.testing.deepspeed import prepare_deepspeed

            prepare_deepspeed()
            import deepspeed

            initialize = deepspeed.initialize
        else:
            import flatzero

            initialize = flatzero.initialize
        if name.endswith("-torch"):
            del config["optimizer"]
            adamw = {**ADAMW, "betas": tuple(ADAMW["betas"])}
            client = torch.optim.AdamW(model.parameters(), fused=True, **adamw)
            self.engine, opt, *_ = initialize(model=model, optimizer=client, config=config)
        else:
            self.engine, opt, *_ = initialize(
                model=model, model_parameters=model.parameters(), config=config
            )
        inner = getattr(opt, "inner", None) or getattr(opt, "optimizer", opt)
        self.inner_optimizer = type(inner).__name__

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.engine(ids, labels=ids).loss

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()


def rank_main(rank: int, world_size: int, spec: OffloadStepSpec) -> dict[str, Any]:
    """This rank's copies of the model, one per method, trained on the same batches, the
    methods alternating step by step (the order reversed every other step)."""
    from flatzero.models import build_model, count_params
    from flatzero.models.bench_models import STEP_MODELS as MODELS

    torch.set_num_threads(threads_per_rank(world_size))
    config = MODELS[spec.model]()
    dtype = BENCH_DTYPES[spec.dtype]
    pristine = build_model(config, device="cpu", dtype=dtype, seed=0)
    state = {k: v.detach().clone() for k, v in pristine.state_dict().items()}
    n_params = count_params(pristine)
    del pristine
    methods: list[_Engine] = []
    for name in spec.methods:
        model = build_model(config, device="meta", dtype=dtype)
        model.to_empty(device="cpu")
        model.load_state_dict(state)
        methods.append(_Engine(name, model, spec))
    del state
    g = torch.Generator().manual_seed(1000)  # the same batches on every rank
    data = [
        torch.randint(0, config.vocab_size, (spec.batch, spec.seq), generator=g)
        for _ in range(spec.warmup + spec.steps)
    ]
    for method in methods:
        for i in range(spec.warmup):
            method.train_step(data[i], record=False)
    for i in range(spec.steps):
        for method in methods if i % 2 == 0 else methods[::-1]:
            method.train_step(data[spec.warmup + i], record=True)
    return {
        "params": n_params,
        "threads": torch.get_num_threads(),
        "times": {m.name: m.times for m in methods},
        "losses": {m.name: m.losses for m in methods},
        "inner_optimizer": {m.name: m.inner_optimizer for m in methods},
    }


def summarize(world_size: int, ranks: list[dict[str, Any]], spec: OffloadStepSpec) -> list[dict]:
    """Per method: medians over steps of the slowest rank's phases, ratios to ``BASELINE``,
    and the losses' largest difference from flatzero-offload's."""
    rows = []
    for name in spec.methods:
        per_step = [
            tuple(max(r["times"][name][i][k] for r in ranks) for k in range(3))
            for i in range(len(ranks[0]["times"][name]))
        ]
        rows.append(
            {
                "world_size": world_size,
                "method": name,
                "inner_optimizer": ranks[0]["inner_optimizer"][name],
                "fwd_s": statistics.median(s[0] for s in per_step),
                "bwd_s": statistics.median(s[1] for s in per_step),
                "step_s": statistics.median(s[2] for s in per_step),
                "bwd_plus_step_s": statistics.median(s[1] + s[2] for s in per_step),
                "total_s": statistics.median(sum(s) for s in per_step),
                "total_s_steps": [sum(s) for s in per_step],
                "losses": ranks[0]["losses"][name],
                "timed_steps": len(per_step),
            }
        )
    by_name = {row["method"]: row for row in rows}
    base = by_name.get(BASELINE)
    ref = by_name.get("flatzero-offload")
    for row in rows:
        row["x_baseline"] = (
            {k[:-2]: row[k] / base[k] for k in ("bwd_s", "step_s", "bwd_plus_step_s", "total_s")}
            if base
            else None
        )
        row["loss_max_abs_diff"] = (
            max(abs(a - b) for a, b in zip(row["losses"], ref["losses"], strict=True))
            if ref
            else None
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The step part's table."""
    head = (
        f"{'ranks':>5} {'method':<24} {'inner':<17} {'fwd ms':>7} {'bwd ms':>7} "
        f"{'step ms':>8} {'total ms':>9} {'step x ds':>9} {'total x ds':>10} {'max |dloss|':>11}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        x, dloss = r["x_baseline"], r["loss_max_abs_diff"]
        lines.append(
            f"{r['world_size']:>5} {r['method']:<24} {r['inner_optimizer']:<17} "
            f"{r['fwd_s'] * 1e3:>7.1f} {r['bwd_s'] * 1e3:>7.1f} {r['step_s'] * 1e3:>8.1f} "
            f"{r['total_s'] * 1e3:>9.1f} {'-' if x is None else format(x['step'], '.3f'):>9} "
            f"{'-' if x is None else format(x['total'], '.3f'):>10} "
            f"{'-' if dloss is None else format(dloss, '.2e'):>11}"
        )
    lines.append(
        f"x ds: over {BASELINE} (median of the slowest rank's times); max |dloss|: the "
        "largest difference of a step's loss from flatzero-offload's"
    )
    return "\n".join(lines)
