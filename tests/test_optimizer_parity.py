"""Parity of ZeroOptimizer with single-process torch.optim.AdamW at world sizes 1-4.

One spawn per world size runs every configuration (stage 1 and 2; fp32, bf16, fp16;
gradient accumulation, clipping, two param groups, a frozen param, a tied param, a param
without gradient on some steps and ranks), the memory checks and the collective error
checks. The reference runs on rank 0 (world size 1: in this process, with no process
group) over the same data, chunked as the ranks see it.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flatzero import FlattenConfig
from flatzero.launch import run_ranks
from flatzero.models import Qwen3MoeConfig, build_model
from flatzero.optim import LossScaleConfig, ZeroConfig, ZeroOptimizer
from tiny_configs import TINY_LLAMA

MOE = Qwen3MoeConfig(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    moe_intermediate_size=16,
    num_experts=8,
    num_experts_per_tok=2,
    expert_layout="unfused",
)
STEPS = 20
MICRO = 2  # micro-batches per step (gradient accumulation)
BATCH = 2  # sequences per micro-batch
SEQ = 12
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Case:
    """One training run to compare."""

    stage: int
    dtype: str = "fp32"
    clip: float | None = 0.5
    model: str = "llama"
    overflow_at: tuple[tuple[int, int], ...] = ()  # (step, rank) whose loss is made inf
    growth_interval: int = 1000
    bucket_numel: int = 4000
    reduce: str = "fp32"  # ZeroConfig.reduce_dtype
    device: str = "cpu"  # "cuda": the GPU tests reuse this harness


class Harness(nn.Module):
    """A zoo model with tied embeddings, a frozen norm, and an extra param ``aux`` that
    gets a gradient only on some steps and ranks."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        dtype = DTYPES[case.dtype]
        config = TINY_LLAMA if case.model == "llama" else MOE
        self.lm = build_model(config, device="cpu", dtype=dtype, seed=0, tie_embeddings=True)
        self.aux = nn.Parameter(torch.linspace(-0.5, 0.5, config.hidden_size).to(dtype))
        self.lm.model.layers[0].input_layernorm.weight.requires_grad_(False)
        self.to(case.device)

    def loss(self, ids: torch.Tensor, use_aux: bool) -> torch.Tensor:
        out = self.lm(ids, labels=ids)
        loss = out.loss
        if use_aux:
            hidden = out.last_hidden_state.float().mean(dim=(0, 1))
            loss = loss + 0.1 * (hidden * self.aux.float()).sum()
        return loss

    def groups(self) -> list[dict]:
        named = list(self.named_parameters())
        return [
            {"params": [(n, p) for n, p in named if p.dim() >= 2], "lr": 3e-3, "weight_decay": 0.1},
            {"params": [(n, p) for n, p in named if p.dim() < 2], "lr": 5e-3, "weight_decay": 0.0},
        ]


def use_aux(step: int, micro: int, rank: int) -> bool:
    """aux: no gradient anywhere on steps 0, 3, ...; on rank 0 only on steps 1, 4, ..."""
    return (step % 3 == 1 and rank == 0) or (step % 3 == 2 and micro == 0)


def batches(world_size: int) -> torch.Tensor:
    """Token ids ``[step, micro, rank, batch, seq]``, the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(
        0, TINY_LLAMA.vocab_size, (STEPS, MICRO, world_size, BATCH, SEQ), generator=g
    )


def micro_loss(h: Harness, data, case: Case, step: int, micro: int, rank: int) -> torch.Tensor:
    ids = data[step, micro, rank].to(h.aux.device)
    loss = h.loss(ids, use_aux(step, micro, rank)) / MICRO
    if (step, rank) in case.overflow_at and micro == 0:
        loss = loss * math.inf
    return loss


ADAMW = {"betas": (0.9, 0.95), "eps": 1e-8}


@dataclass
class Result:
    """The outcome of a training run.

    Attributes:
        masters: fp32 master value of every trainable param, by name.
        params: every param of the model (in its dtype), by name.
        scales: the loss scale used at each step.
        skipped: whether each step was skipped (fp16 overflow).
        changed: whether each step changed any bucket or master element (ZeroOptimizer).
    """

    masters: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    scales: list[float]
    skipped: list[bool]
    changed: list[bool] | None = None


def run_zero(rank: int, world_size: int, case: Case) -> Result:
    """Train with ZeroOptimizer on this rank's micro-batches."""
    torch.manual_seed(0)
    data = batches(world_size)
    h = Harness(case)
    scale = LossScaleConfig(growth_interval=case.growth_interval) if case.dtype == "fp16" else None
    opt = ZeroOptimizer(
        h.groups(),
        torch.optim.AdamW,
        stage=case.stage,
        config=ZeroConfig(
            max_grad_norm=case.clip, loss_scale=scale, reduce_dtype=DTYPES[case.reduce]
        ),
        flatten_config=FlattenConfig(
            bucket_numel=case.bucket_numel, device=case.device, progress=False
        ),
        **ADAMW,
    )
    scales, skipped, changed = [], [], []
    for step in range(STEPS):
        for micro in range(MICRO):
            opt.backward(micro_loss(h, data, case, step, micro, rank))
        scales.append(opt.loss_scale)
        before = flat_snapshot(opt)
        opt.step()
        changed.append(not torch.equal(before, flat_snapshot(opt)))
        skipped.append(opt.last_step_skipped)
        opt.zero_grad()
    masters = {n: m.cpu() for n, m in opt.full_params().items()}
    params = {n: p.detach().cpu() for n, p in h.named_parameters()}
    opt.close()
    return Result(masters, params, scales, skipped, changed)


def flat_snapshot(opt: ZeroOptimizer) -> torch.Tensor:
    """Every bucket and master shard of ``opt``, as one fp32 vector."""
    parts = [b.float() for g in opt.flat.groups for b in g.buckets] + opt.master_shards
    return torch.cat(parts)


def run_plain_adamw(world_size: int, case: Case) -> Result:
    """fp32 reference: plain torch AdamW on one process over the global batch."""
    data = batches(world_size)
    h = Harness(case)
    opt = torch.optim.AdamW(
        [{**g, "params": [p for _, p in g["params"] if p.requires_grad]} for g in h.groups()],
        **ADAMW,
    )
    trainable = [p for p in h.parameters() if p.requires_grad]
    for step in range(STEPS):
        for micro in range(MICRO):
            for rank in range(world_size):
                (micro_loss(h, data, case, step, micro, rank) / world_size).backward()
        for p in trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # no gradient counts as a zero gradient
        if case.clip is not None:
            torch.nn.utils.clip_grad_norm_(trainable, case.clip)
        opt.step()
        opt.zero_grad()
    params = {n: p.detach().clone() for n, p in h.named_parameters()}
    masters = {n: p for n, p in params.items() if dict(h.named_parameters())[n].requires_grad}
    return Result(masters, params, [1.0] * STEPS, [False] * STEPS)


def run_mixed_reference(world_size: int, case: Case) -> Result:
    """bf16/fp16 reference: the same computation on one process with an fp32 master copy.

    Each rank's micro-batch gradients are computed in the model's dtype exactly as that
    rank does; stage 1 accumulates them over micro-batches in the model's dtype (autograd),
    stage 2 in fp32; ranks are summed in fp32, divided by world size and loss scale,
    clipped, and (fused) AdamW steps the fp32 masters, which are cast into the model. fp16: the
    dynamic loss-scaling rule (skip on inf/nan, halve; double after ``growth_interval``).
    """
    data = batches(world_size)
    h = Harness(case)
    named = [(n, p) for n, p in h.named_parameters() if p.requires_grad]
    masters = {n: p.detach().float().clone().requires_grad_() for n, p in named}
    opt = torch.optim.AdamW(
        [
            {**g, "params": [masters[n] for n, p in g["params"] if p.requires_grad]}
            for g in h.groups()
        ],
        **ADAMW,
        fused=True,  # as ZeroOptimizer picks for AdamW: the same kernel
    )
    scale = 2.0**16 if case.dtype == "fp16" else 1.0
    good = 0
    scales, skipped = [], []
    for step in range(STEPS):
        total = {n: torch.zeros_like(m) for n, m in masters.items()}
        for rank in range(world_size):
            per_rank = {n: torch.zeros_like(m) for n, m in masters.items()}
            for micro in range(MICRO):
                (micro_loss(h, data, case, step, micro, rank) * scale).backward()
                if case.stage == 2:
                    for n, p in named:
                        if p.grad is not None:
                            per_rank[n] += p.grad.float()
                        p.grad = None
            if case.stage == 1:
                for n, p in named:
                    if p.grad is not None:
                        per_rank[n] += p.grad.float()
                    p.grad = None
            for n in total:
                total[n] += per_rank[n]
        scales.append(scale)
        grads = {n: g / (world_size * scale) for n, g in total.items()}
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])
        )
        if case.dtype == "fp16" and not torch.isfinite(norm):
            scale *= 0.5
            good = 0
            skipped.append(True)
            continue
        skipped.append(False)
        if case.clip is not None:
            coef = min(1.0, case.clip / (float(norm) + 1e-6))
            grads = {n: g * coef for n, g in grads.items()}
        for n, m in masters.items():
            m.grad = grads[n]
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for n, p in named:
                p.copy_(masters[n])
        if case.dtype == "fp16":
            good += 1
            if good == case.growth_interval:
                scale *= 2.0
                good = 0
    params = {n: p.detach().clone() for n, p in h.named_parameters()}
    return Result({n: m.detach() for n, m in masters.items()}, params, scales, skipped)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def reference(world_size: int, case: Case) -> Result:
    """The reference run of ``case`` (fp32: plain AdamW; else the mixed-precision rule)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        if case.dtype == "fp32":
            return run_plain_adamw(world_size, case)
        return run_mixed_reference(world_size, case)
    finally:
        torch.set_num_threads(threads)


def update_err(ours: dict, ref: dict, init: dict) -> float:
    """``||ours - ref|| / ||ref - init||`` over all trainable params."""
    num = sum(float((ours[n].double() - ref[n].double()).norm() ** 2) for n in init)
    den = sum(float((ref[n].double() - init[n].double()).norm() ** 2) for n in init)
    return math.sqrt(num / den)


def initial_values(case: Case) -> dict[str, torch.Tensor]:
    h = Harness(case)
    return {n: p.detach().float().clone() for n, p in h.named_parameters() if p.requires_grad}


def check_against_reference(world_size: int, case: Case, got: Result) -> None:
    ref = reference(world_size, case)
    assert got.masters.keys() == ref.masters.keys()
    frozen = "lm.model.layers.0.input_layernorm.weight"
    assert frozen not in got.masters and torch.equal(got.params[frozen], ref.params[frozen])
    if case.dtype == "fp32":
        worst = max(rel_err(got.params[n], v) for n, v in ref.params.items())
        print(f"{case}: world size {world_size}, worst relative error {worst:.2e}")
        for name, value in ref.params.items():
            assert rel_err(got.params[name], value) <= 1e-5, (case, name)
            assert rel_err(got.masters.get(name, value), value) <= 1e-5, (case, name)
        return
    # Mixed precision: the same computation, up to rounding; bf16 rounding makes the two
    # runs drift apart a little, so compare the updates (a bug shows as >10% of one).
    assert got.scales == ref.scales, case
    assert got.skipped == ref.skipped, case
    err = update_err(got.masters, ref.masters, initial_values(case))
    print(f"{case}: world size {world_size}, update error {err:.2e}")
    assert err < 0.02, (case, err)
    for name, value in ref.params.items():
        assert got.params[name].dtype == value.dtype


def cases(world_size: int) -> list[Case]:
    """What runs at ``world_size``: the core set everywhere, the rest at 1 and 2 (the MoE
    at 3 too), to keep the suite short."""
    last = world_size - 1
    core = [
        Case(stage=1),
        Case(stage=2, bucket_numel=700),
        Case(stage=1, dtype="bf16"),
        Case(stage=2, dtype="bf16"),
        Case(stage=2, dtype="fp16", overflow_at=((3, last),), growth_interval=4),
    ]
    moe = [Case(stage=2, model="moe", bucket_numel=2000)]
    extra = [
        Case(stage=1, dtype="fp16", overflow_at=((5, 0),), clip=None, growth_interval=3),
        Case(stage=1, dtype="bf16", reduce="bf16"),
        Case(stage=2, dtype="bf16", reduce="bf16", bucket_numel=700),
    ]
    if world_size <= 2:
        return core + moe + extra
    return core + moe if world_size == 3 else core


def check_fp16(case: Case, got: Result) -> None:
    for step, _ in case.overflow_at:
        assert got.skipped[step], (case, step)
        assert not got.changed[step], "an overflowing step must change nothing"
        assert got.scales[step + 1] == got.scales[step] / 2
    pairs = zip(got.scales, got.scales[1:], strict=False)
    assert any(b == 2 * a for a, b in pairs), "the scale must grow again after clean steps"
    assert all(c != s for c, s in zip(got.changed, got.skipped, strict=True))


@pytest.fixture
def one_thread():
    """One intra-op thread, as each rank uses (more threads on 2 shared cores thrash)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("case", cases(1), ids=str)
def test_parity_world_size_1_without_process_group(case, one_thread):
    assert not dist.is_initialized()
    got = run_zero(0, 1, case)
    check_against_reference(1, case, got)
    if case.dtype == "fp16":
        check_fp16(case, got)


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_is_the_same_computation_bit_for_bit_without_clipping(stage, one_thread):
    case = Case(stage=stage, dtype="bf16", clip=None)
    got, ref = run_zero(0, 1, case), reference(1, case)
    for name, value in ref.masters.items():
        assert torch.equal(got.masters[name], value), name
    for name, value in ref.params.items():
        assert torch.equal(got.params[name], value), name


# ------------------------------------------------------------------ multi-process
STAGING_BYTES = 4096
"""The staging budget of the memory checks: less than one bucket in fp32."""


def _memory_checks(rank: int, world_size: int) -> dict:
    """Gradient memory after a backward pass, stage 2 and stage 1."""
    out = {}
    data = batches(world_size)
    for stage in (2, 1):
        case = Case(stage=stage)
        h = Harness(case)
        opt = ZeroOptimizer(
            h.groups(),
            stage=stage,
            config=ZeroConfig(reduce_staging_bytes=STAGING_BYTES),
            flatten_config=FlattenConfig(
                bucket_numel=case.bucket_numel, device=case.device, progress=False
            ),
        )
        h.loss(data[0, 0, rank], use_aux=True).backward()
        trainable = [p for p in h.parameters() if p.requires_grad]
        layout_numel = sum(g.layout.numel for g in opt.flat.groups)
        shard_numel = sum(g.numel() for g in opt.grad_shards)
        param_bytes = sum(p.numel() * 4 for p in trainable)
        if stage == 2:
            out["stage2_no_grads"] = all(p.grad is None for p in trainable)
            out["stage2_shard_fraction"] = shard_numel / layout_numel
            staging_bytes = opt._reducer.staging_bytes
            out["stage2_staging_bytes"] = staging_bytes
            out["stage2_grad_bytes_accounted"] = (
                opt.gradient_bytes() == shard_numel * 4 + staging_bytes
            )
            out["stage2_shard_bytes_over_model"] = shard_numel * 4 / param_bytes
        else:
            buffers = opt.flat_grad_buffers
            storages = {b.untyped_storage().data_ptr() for b in buffers}
            out["stage1_buffers_per_group"] = len(buffers) == len(opt.flat.groups)
            out["stage1_grads_are_views"] = all(
                p.grad is not None and p.grad.untyped_storage().data_ptr() in storages
                for p in trainable
            )
            out["stage1_flat_numel"] = sum(b.numel() for b in buffers) == layout_numel
        opt.step()
        opt.close()
    return out


def _error_checks(rank: int, world_size: int) -> dict:
    """Collective errors: every rank raises the same way, nothing is changed."""
    out = {}
    # Different params on the last rank.
    h = Harness(Case(stage=2))
    if rank == world_size - 1:
        h.extra = nn.Parameter(torch.zeros(3))
    ptrs = [p.data_ptr() for p in h.parameters()]
    try:
        ZeroOptimizer(h.parameters(), flatten_config=FlattenConfig(device="cpu", progress=False))
        out["mismatch"] = "no error"
    except ValueError as e:
        out["mismatch"] = str(e)
    out["mismatch_unchanged"] = ptrs == [p.data_ptr() for p in h.parameters()]

    # A different stage on rank 0.
    h = Harness(Case(stage=2))
    try:
        ZeroOptimizer(h.parameters(), stage=1 if rank == 0 else 2)
        out["stage_mismatch"] = "no error"
    except ValueError as e:
        out["stage_mismatch"] = str(e)

    # Save, keep training, load into a fresh optimizer: the same trajectory.
    data = batches(world_size)

    def make(bucket_numel: int = 1500):
        model = Harness(Case(stage=2))
        opt = ZeroOptimizer(
            model.groups(),
            config=ZeroConfig(max_grad_norm=1.0),
            flatten_config=FlattenConfig(bucket_numel=bucket_numel, device="cpu", progress=False),
            lr=1e-3,
        )
        return model, opt

    def train(model, opt, steps):
        for step in steps:
            model.loss(data[step, 0, rank], use_aux(step, 0, rank)).backward()
            opt.step()

    a, opt_a = make()
    train(a, opt_a, range(3))
    saved = {k: v for k, v in opt_a.state_dict().items()}
    saved["master"] = [m.clone() for m in saved["master"]]
    saved["optimizer"] = {
        "param_groups": [dict(g) for g in saved["optimizer"]["param_groups"]],
        "state": {
            i: {k: v.clone() for k, v in s.items()} for i, s in saved["optimizer"]["state"].items()
        },
    }
    train(a, opt_a, range(3, 5))
    b, opt_b = make()
    opt_b.load_state_dict(saved)
    out["loaded_masters_equal"] = all(
        torch.equal(x, y) for x, y in zip(opt_b.master_shards, saved["master"], strict=True)
    )
    out["loaded_params_match_masters"] = all(
        torch.equal(opt_b.full_param(n), p.float())
        for n, p in zip(opt_b.flat.groups[0].names, opt_b.flat.groups[0].params, strict=True)
    )
    train(b, opt_b, range(3, 5))
    out["resume_equal"] = all(
        torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True)
    )

    # Loading another layout's shard, or (on rank 0 only) another rank's: all ranks raise.
    _, opt_c = make(bucket_numel=700)
    before = flat_snapshot(opt_c)
    try:
        opt_c.load_state_dict(saved)
        out["other_layout"] = "no error"
    except ValueError as e:
        out["other_layout"] = str(e)
    out["other_layout_unchanged"] = torch.equal(before, flat_snapshot(opt_c))
    wrong = dict(saved)
    if rank == 0:
        wrong["rank"] = world_size
    before = flat_snapshot(opt_b)
    try:
        opt_b.load_state_dict(wrong)
        out["wrong_rank"] = "no error"
    except ValueError as e:
        out["wrong_rank"] = str(e)
    out["wrong_rank_unchanged"] = torch.equal(before, flat_snapshot(opt_b))
    return out


def _worker(rank: int, world_size: int) -> bytes:
    torch.set_num_threads(1)
    results = {case: run_zero(rank, world_size, case) for case in cases(world_size)}
    out = {
        "results": results,
        "memory": _memory_checks(rank, world_size),
        "errors": _error_checks(rank, world_size),
    }
    buffer = io.BytesIO()  # tensors through a queue would need the child alive: serialize
    torch.save(out, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_distributed_parity_memory_and_errors(world_size):
    outputs = [
        torch.load(io.BytesIO(blob), weights_only=False)
        for blob in run_ranks(_worker, world_size, timeout_s=120)
    ]
    first = outputs[0]["results"]
    for case in cases(world_size):
        got = first[case]
        for other in outputs[1:]:  # every rank ends with the same params and masters
            theirs = other["results"][case]
            for name, value in got.params.items():
                assert torch.equal(theirs.params[name], value), (case, name)
            for name, value in got.masters.items():
                assert torch.equal(theirs.masters[name], value), (case, name)
            assert theirs.skipped == got.skipped and theirs.scales == got.scales
        check_against_reference(world_size, case, got)
        if case.dtype == "fp16":
            check_fp16(case, got)

    for out in outputs:
        memory = out["memory"]
        assert memory["stage2_no_grads"]
        assert memory["stage2_shard_fraction"] == 1 / world_size
        assert 0 < memory["stage2_staging_bytes"] <= STAGING_BYTES
        # Gradient memory: the 1/N shard (plus padding) and at most the staging budget,
        # whatever the model and bucket sizes.
        assert memory["stage2_grad_bytes_accounted"]
        assert memory["stage2_shard_bytes_over_model"] < 1 / world_size + 0.05
        assert memory["stage1_buffers_per_group"]
        assert memory["stage1_grads_are_views"]
        assert memory["stage1_flat_numel"]

        errors = out["errors"]
        assert "the flatten setup differs between ranks: layout digest" in errors["mismatch"], (
            errors["mismatch"]
        )
        assert errors["mismatch_unchanged"]
        assert "differs between ranks" in errors["stage_mismatch"]
        assert errors["loaded_masters_equal"]
        assert errors["loaded_params_match_masters"]
        assert errors["resume_equal"]
        assert "another layout" in errors["other_layout"]
        assert errors["other_layout_unchanged"]
        assert errors["wrong_rank_unchanged"]
    assert (
        "rank 0's shard" in outputs[0]["errors"]["wrong_rank"]
        or "this is rank 0" in (outputs[0]["errors"]["wrong_rank"])
    )
    for out in outputs[1:]:
        assert "another rank" in out["errors"]["wrong_rank"]
