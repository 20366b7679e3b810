"""Muon's momentum across the border with DeepSpeed 0.19.8's ZeRO-1/2 checkpoints (CPU,
gloo, 2 ranks; skipped without DeepSpeed).

One spawn, at ZeRO stage 2: flatzero's door trains the ``Muon`` config ``K`` steps, saves, and
trains ``M`` more (the reference); the save, exported with ``to_deepspeed``, resumes in
real DeepSpeed with the same ``M`` losses. That DeepSpeed run then saves its own checkpoint
and trains ``M`` more; its checkpoint, imported with ``from_deepspeed``, resumes in
flatzero's door with the same ``M`` losses. Both resumes start from a model of other
weights, and the momentum (0.9) moves every later loss: a lost or misplaced momentum
shows. The exported
files hold DeepSpeed's own Muon format (``flatzero.deepspeed.muon_state``).
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from flatzero.launch import run_ranks

pytest.importorskip("transformers")

K, M = 2, 3
STAGES = (2,)
"""ZeRO stages run (stage 1 takes DeepSpeed's same Muon path, get_flat_partition: it passed
too when run, and is left out to keep the suite's time)."""
ENV = {"DS_ACCELERATOR": "cpu", "TORCHDYNAMO_DISABLE": "1"}
TOLERANCE = 1e-5
"""The door's fp32 tolerance against DeepSpeed (tests/test_deepspeed_muon.py)."""


def _llama(seed: int) -> torch.nn.Module:
    """A Llama whose sizes do not divide evenly over 2 ranks (matrices split between them)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=61, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _config(stage: int) -> dict[str, Any]:
    params = {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.01, "adam_lr": 3e-3}
    return {
        "train_batch_size": 2,
        "steps_per_print": 2**31 - 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Muon", "params": params},
    }


def _train(engine: Any, rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(1000 * step + rank)
        ids = torch.randint(0, 61, (1, 12), generator=gen)
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _on_rank0(rank: int, work: Any) -> None:
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        work()
    dist.barrier()


def _stage(rank: int, root: Path, stage: int) -> dict[str, list[float]]:
    import deepspeed

    import flatzero
    from flatzero.deepspeed.convert import from_deepspeed, to_deepspeed
    from flatzero.testing.deepspeed import release_engine

    config, quiet = _config(stage), contextlib.redirect_stdout(io.StringIO())
    out: dict[str, list[float]] = {}
    engine = flatzero.initialize(model=_llama(0), config=config)[0]
    _train(engine, rank, range(K))
    engine.save_checkpoint(root / "fz")
    out["flatzero"] = _train(engine, rank, range(K, K + M))
    engine.destroy()
    _on_rank0(
        rank,
        lambda: to_deepspeed(
            root / "fz", root / "exported", world_size=2, ds_config=config, progress=False
        ),
    )
    with quiet:
        engine = deepspeed.initialize(model=_llama(1), config=config)[0]
        engine.load_checkpoint(str(root / "exported"))
    out["deepspeed_resumed"] = _train(engine, rank, range(K, K + M))
    with quiet:
        engine.save_checkpoint(str(root / "ds"))  # DeepSpeed's own, after K + M steps
    out["deepspeed"] = _train(engine, rank, range(K + M, K + 2 * M))
    release_engine(engine)
    _on_rank0(rank, lambda: from_deepspeed(root / "ds", root / "imported", progress=False))
    engine = flatzero.initialize(model=_llama(1), config=config)[0]
    engine.load_checkpoint(root / "imported")
    out["flatzero_resumed"] = _train(engine, rank, range(K + M, K + 2 * M))
    engine.destroy()
    return out


def _rank(rank: int, world_size: int, root: str) -> dict[int, dict[str, list[float]]]:
    from flatzero.testing.deepspeed import prepare_deepspeed

    prepare_deepspeed(warmup=False)
    return {stage: _stage(rank, Path(root) / f"zero{stage}", stage) for stage in STAGES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list[dict]]:
    from flatzero.testing.deepspeed import deepspeed_available

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ok, why = deepspeed_available()
    if not ok:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("muon_ckpt")
    return root, run_ranks(_rank, 2, str(root), env=ENV, timeout_s=300)


@pytest.mark.parametrize("stage", STAGES)
def test_deepspeed_resumes_a_flatzero_muon_export(runs, stage):
    _, by_rank = runs
    for rank in by_rank:
        got, want = rank[stage]["deepspeed_resumed"], rank[stage]["flatzero"]
        assert got == pytest.approx(want, rel=TOLERANCE), stage


@pytest.mark.parametrize("stage", STAGES)
def test_flatzero_resumes_a_deepspeed_muon_checkpoint(runs, stage):
    _, by_rank = runs
    for rank in by_rank:
        got, want = rank[stage]["flatzero_resumed"], rank[stage]["deepspeed"]
        assert got == pytest.approx(want, rel=TOLERANCE), stage


def test_exported_momentum_is_in_deepspeeds_own_format(runs):
    """Per rank, the Muon group's momentum is the whole momentum of the params in its
    partition (as long as DeepSpeed's own file's), matrices in DeepSpeed's order."""
    from flatzero.deepspeed import pickle as ds_pickle

    root, _ = runs

    def read(directory: Path, rank: int) -> tuple[dict, list]:
        tag = (directory / "latest").read_text().strip()
        optim = ds_pickle.load(directory / tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        model = ds_pickle.load(directory / tag / "mp_rank_00_model_states.pt")
        return optim["optimizer_state_dict"]["base_optimizer_state"], model["param_shapes"]

    for rank in range(2):
        ours, our_shapes = read(root / "zero2" / "exported", rank)
        theirs, their_shapes = read(root / "zero2" / "ds", rank)
        assert [list(g) for g in our_shapes] == [list(g) for g in their_shapes]
        assert (
            ours["state"][0]["momentum_buffer"].shape == theirs["state"][0]["momentum_buffer"].shape
        )
        assert set(ours["state"][1]) == set(theirs["state"][1])  # FusedAdam's Adam half
        assert [g["use_muon"] for g in ours["param_groups"]] == [True, False]


def test_a_deepspeed_muon_checkpoint_round_trips_through_flatzero(runs, tmp_path):
    """DeepSpeed's checkpoint imported, then exported again (the imported checkpoint records
    no optimizer class: its Muon groups are known by ``use_muon``): DeepSpeed's own Muon
    momentum, masters and flat order come back exactly."""
    from flatzero.deepspeed import pickle as ds_pickle
    from flatzero.deepspeed.convert import from_deepspeed, to_deepspeed

    root, _ = runs
    source = root / "zero2" / "ds"
    from_deepspeed(source, tmp_path / "fz", progress=False)
    to_deepspeed(tmp_path / "fz", tmp_path / "ds", world_size=2, progress=False)
    tag = (source / "latest").read_text().strip()
    for rank in range(2):
        name = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        theirs = ds_pickle.load(source / tag / name)["optimizer_state_dict"]
        ours = ds_pickle.load(tmp_path / "ds" / tag / name)["optimizer_state_dict"]
        for a, b in zip(
            ours["single_partition_of_fp32_groups"],
            theirs["single_partition_of_fp32_groups"],
            strict=True,
        ):
            assert torch.equal(a, b)
        momentum = [
            s["base_optimizer_state"]["state"][0]["momentum_buffer"] for s in (ours, theirs)
        ]
        assert torch.equal(*momentum)


def test_torchs_muon_and_muon_with_offload_are_refused_saying_why(runs, tmp_path):
    """torch's Muon has no DeepSpeed ZeRO-1/2 form (DeepSpeed's flat 1-D partitions; its Muon
    is another update), even with ``any_optimizer``; DeepSpeed's Muon with optimizer offload
    keeps another format. A config without ``gradient_clipping`` exports DeepSpeed's
    default, 1.0 (the door clipped at it: a 0 would stop the resumed run's clipping)."""
    from flatzero import FlattenConfig, ZeroOptimizer
    from flatzero.checkpoint import save_checkpoint
    from flatzero.deepspeed import pickle as ds_pickle
    from flatzero.deepspeed.convert import to_deepspeed

    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Linear(10, 3, bias=False))
    opt = ZeroOptimizer(
        [p for p in model.parameters() if p.ndim == 2],
        torch.optim.Muon,
        flatten_config=FlattenConfig(progress=False),
        lr=0.02,
    )
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path / "torch", opt, model=model)
    opt.close()
    for any_optimizer in (False, True):
        with pytest.raises(ValueError, match=r"torch\.optim\.Muon: a DeepSpeed ZeRO-1/2 run"):
            to_deepspeed(
                tmp_path / "torch", tmp_path / "out", world_size=1, any_optimizer=any_optimizer
            )
    door, config = runs[0] / "zero2" / "fz", _config(2)
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    with pytest.raises(ValueError, match=r"Muon with zero_optimization\.offload_optimizer"):
        to_deepspeed(door, tmp_path / "out", world_size=2, ds_config=config)
    result = to_deepspeed(door, tmp_path / "plain", world_size=2, ds_config=_config(2))
    optim = ds_pickle.load(next(result.path.glob("zero_pp_rank_0_*")))["optimizer_state_dict"]
    assert optim["clip_grad"] == 1.0
