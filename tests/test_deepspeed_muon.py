"""DeepSpeed 0.19.8's ``Muon`` optimizer config through flatzero's door, side by side with
the real DeepSpeed (CPU, gloo; skipped without DeepSpeed): the same losses at ZeRO stages 1
and 2, each matrix orthogonalized once per step over all ranks, and Muon (not SGD) at
stage 0 (DeepSpeed #8441)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from flatzero.launch import run_ranks

pytest.importorskip("transformers")

STEPS = 10
ENV = {"DS_ACCELERATOR": "cpu", "TORCHDYNAMO_DISABLE": "1"}
"""DeepSpeed on the CPU; its ``torch.compile``d Muon kernels run eagerly (compiling them
takes most of a minute on 2 cores)."""
CASES = ((1, torch.float32), (2, torch.float32), (2, torch.bfloat16))
"""(ZeRO stage, training dtype) run side by side."""
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-3}
"""The door's relative loss tolerances against DeepSpeed (tests/test_deepspeed_import.py's
for bf16: DeepSpeed keeps bf16 Muon momentum, flatzero fp32)."""


def _llama() -> torch.nn.Module:
    """A Llama whose sizes do not divide evenly over 2 ranks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=61, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _config(stage: int, world_size: int) -> dict[str, Any]:
    params = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.01, "adam_lr": 3e-3}
    return {
        "train_batch_size": world_size,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Muon", "params": params},
    }


def _losses(engine: Any, rank: int, steps: int = STEPS) -> list[float]:
    gen = torch.Generator().manual_seed(10 + rank)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 61, (1, 12), generator=gen)
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _side_by_side(rank: int, world_size: int) -> dict[int, Any]:
    from flatzero.testing.deepspeed import prepare_deepspeed, release_engine

    prepare_deepspeed()
    import deepspeed

    import flatzero
    from flatzero.optim import deepspeed_muon

    calls: list[tuple[int, ...]] = []
    orthogonalize = deepspeed_muon.orthogonalize
    deepspeed_muon.orthogonalize = lambda u, m: calls.append(tuple(u.shape)) or orthogonalize(u, m)
    out = {}
    for stage, dtype in CASES:
        config = _config(stage, world_size)
        config["bf16"] = {"enabled": dtype == torch.bfloat16}
        engine, *_ = deepspeed.initialize(model=_llama().to(dtype), config=config)
        theirs = _losses(engine, rank)
        release_engine(engine)
        engine, *_ = flatzero.initialize(model=_llama().to(dtype), config=config)
        calls.clear()  # probes of the class at construction
        ours = _losses(engine, rank)
        groups = [(g["name"], g["use_muon"]) for g in engine.optimizer.param_groups]
        engine.destroy()
        out[(stage, dtype)] = {"theirs": theirs, "ours": ours, "calls": list(calls)}
        out[(stage, dtype)]["groups"] = groups
    return out


def test_muon_config_matches_deepspeed_and_orthogonalizes_each_matrix_once():
    """10 steps of a Llama (sizes uneven over 2 ranks) under the same ``Muon`` config, fp32
    at stages 1 and 2, bf16 at stage 2: flatzero's losses are DeepSpeed's on every rank,
    the params split into DeepSpeed's halves, and each Muon matrix is orthogonalized
    exactly once per step over both ranks (DeepSpeed's ZeRO does it on every co-owner of
    a split matrix)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    by_rank = run_ranks(_side_by_side, 2, env=ENV)
    muon = sorted(
        tuple(p.shape)
        for n, p in _llama().named_parameters()
        if p.dim() >= 2 and "embed" not in n and "lm_head" not in n
    )
    for case in CASES:
        out = [r[case] for r in by_rank]
        for rank in out:
            assert rank["ours"] == pytest.approx(rank["theirs"], rel=TOLERANCE[case[1]]), case
        assert out[0]["groups"] == [("muon-params", True), ("adam-params", False)]
        calls = sorted(out[0]["calls"] + out[1]["calls"])
        assert calls == sorted(muon * STEPS), case  # each matrix once per step, both ranks
        assert out[0]["calls"] and out[1]["calls"]  # both ranks own matrices


def _stage0_rank(rank: int, world_size: int) -> dict[str, Any]:
    import flatzero

    model = _llama()
    name = "model.layers.0.mlp.down_proj.weight"
    before = dict(model.named_parameters())[name].detach().clone()
    config = _config(0, world_size)
    config["gradient_clipping"] = 0.0
    config["optimizer"]["params"]["weight_decay"] = 0.0
    engine, *_ = flatzero.initialize(model=model, config=config)
    ids = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(ids, labels=ids).loss)
    engine.step()
    after = dict(engine.module.named_parameters())[name].detach().float()
    reference = _llama()
    reference(ids, labels=ids).loss.backward()
    engine.destroy()
    return {
        "update": torch.linalg.svdvals((before - after) / 0.02).tolist(),
        "grad": torch.linalg.svdvals(dict(reference.named_parameters())[name].grad).tolist(),
    }


def test_muon_at_stage_0_orthogonalizes_not_sgd():
    """DeepSpeed #8441: Muon at stage 0 ran SGD. Through the router a stage 0 Muon config
    comes to flatzero, whose step of a matrix is orthogonalized: its singular values are
    alike (Newton-Schulz leaves them in about [0.5, 1.5]), where the gradient's (SGD's
    update) spread over orders of magnitude."""
    from flatzero.deepspeed.patch import routing_reason

    muon = _config(0, 1)
    assert routing_reason(config=muon) is None  # flatzero runs it
    adam = {**muon, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    assert "stage 0" in routing_reason(config=adam)
    out = run_ranks(_stage0_rank, 1)[0]
    rank = 8  # the gradient of 12 tokens has rank <= 12: compare the leading directions
    update, grad = out["update"][:rank], out["grad"][:rank]
    spread = max(update) / min(update)
    assert spread < 2, update
    assert max(grad) / min(grad) > 2 * spread, grad  # SGD's step: the gradient's spread
    assert min(update) > 0.3 and max(update) < 1.6


def _full_state(engine: Any, name: str) -> dict[str, list]:
    """``{param name: whole per-element state name}`` gathered from every rank's shards
    (groups without that state are left out). Collective."""
    opt = engine.optimizer
    state = opt.state_dict()["optimizer"]["state"]
    out = {}
    for gi, group in enumerate(opt.flat.layout.groups):
        if name not in state[gi]:
            continue
        shard = state[gi][name]
        parts = [torch.empty_like(shard) for _ in range(opt.world_size)]
        torch.distributed.all_gather(parts, shard.contiguous())
        for i, slot in enumerate(group.slots):
            full = torch.empty(slot.numel)
            for rank, piece in group.param_pieces(i):
                run = parts[rank][piece.shard_start : piece.shard_start + piece.numel]
                full[piece.param_start : piece.param_end] = run
            out[slot.spec.name] = full.tolist()
    return out


def _resume_rank(rank: int, world_size: int, directory: str, phase: str) -> dict[str, Any]:
    import flatzero

    engine, *_ = flatzero.initialize(model=_llama(), config=_config(2, world_size))
    if phase == "save":
        _losses(engine, rank, steps=3)
        engine.save_checkpoint(directory, tag="t")
    else:
        engine.load_checkpoint(directory, tag="t")
    out = {name: _full_state(engine, name) for name in ("momentum_buffer", "exp_avg")}
    engine.destroy()
    return out


def test_muon_momentum_saves_and_reshards_through_the_door(tmp_path):
    """``engine.save_checkpoint`` at 2 ranks after 3 steps, ``load_checkpoint`` at 1: every
    matrix's whole Muon momentum and the Adam half's moments are exactly what was saved."""
    saved = run_ranks(_resume_rank, 2, str(tmp_path), "save")[0]
    muon = [n for n, p in _llama().named_parameters() if p.dim() == 2 and "embed" not in n]
    assert sorted(saved["momentum_buffer"]) == sorted(n for n in muon if "lm_head" not in n)
    assert "lm_head.weight" in saved["exp_avg"] and "model.norm.weight" in saved["exp_avg"]
    assert any(v != 0 for v in saved["momentum_buffer"]["model.layers.1.mlp.up_proj.weight"])
    loaded = run_ranks(_resume_rank, 1, str(tmp_path), "load")[0]
    assert loaded == saved


def _kernels_rank(rank: int, world_size: int) -> list[tuple[str, tuple[int, ...], float]]:
    from flatzero.testing.deepspeed import import_deepspeed

    import_deepspeed()
    from deepspeed.runtime.zero.muon.original_muon import muon_update

    from flatzero.optim.deepspeed_muon import DeepSpeedMuon

    out = []
    gen = torch.Generator().manual_seed(0)
    for method in ("gram", "standard"):
        for shape in ((24, 40), (40, 24), (16, 16)):
            p = torch.nn.Parameter(torch.randn(shape, generator=gen))
            theirs, ours = p.detach().clone(), p
            momentum = torch.zeros(shape)
            opt = DeepSpeedMuon([{"params": [ours], "use_muon": True, "ns_method": method}])
            for _ in range(3):
                grad = torch.randn(shape, generator=gen)
                ours.grad = grad.clone()
                opt.step()
                update = muon_update(grad.clone(), momentum, beta=0.95, ns_method=method)
                theirs.add_(update.reshape(shape), alpha=-0.02)
            rel = float((ours.detach() - theirs).norm() / theirs.norm())
            out.append((method, shape, rel))
    return out


def test_muon_update_is_deepspeeds_for_both_newton_schulz_methods():
    """``DeepSpeedMuon``'s step against DeepSpeed's own ``muon_update`` over 3 steps: wide,
    tall and square matrices, ``gram`` and ``standard`` Newton-Schulz. (DeepSpeed's own
    update of a 4-D param raises: its flattened update does not broadcast against the
    gradient.)"""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    for method, shape, rel in run_ranks(_kernels_rank, 1, env=ENV)[0]:
        assert rel < 1e-6, (method, shape, rel)


def test_one_optimizer_steps_its_muon_groups_whole_and_its_adam_groups_flat():
    """``ZeroOptimizer`` with ``DeepSpeedMuon`` (one process): the Muon group keeps only
    the momentum, the Adam group only Adam's moments and step (state homed per group);
    optimizer offload is refused before anything is flattened."""
    import flatzero
    from flatzero.optim.deepspeed_muon import DeepSpeedMuon

    model = torch.nn.Linear(6, 5)
    groups = [
        {"params": [model.weight], "use_muon": True},
        {"params": [model.bias], "use_muon": False},
    ]
    with pytest.raises(TypeError, match="turn optimizer offload off"):
        flatzero.ZeroOptimizer(groups, DeepSpeedMuon, offload_optimizer=True)
    opt = flatzero.ZeroOptimizer(groups, DeepSpeedMuon)
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    state = opt.state_dict()["optimizer"]["state"]
    assert set(state[0]) == {"momentum_buffer"}
    assert set(state[1]) == {"exp_avg", "exp_avg_sq", "step"}
    assert opt.flat.layout.groups[1].shard_numel >= 5  # the bias, flat
    opt.close()
