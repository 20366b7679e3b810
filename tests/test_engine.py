"""The engine of ``flatzero.initialize`` at world size 2 (one spawn) and 1 (one spawn).

World size 2 runs, on every rank: the optimizer parity cases through the engine with a
DeepSpeed config (stages 0, 1, 2; accumulation, clipping, a per-group scheduler; two
param groups, a frozen param, tied embeddings) against plain ``torch.optim.AdamW`` on one
process; a client optimizer and scheduler; bf16 from an fp32 model (cast while
flattening); fp16 overflow skipping; the accumulation boundary; initial-weight sync;
``initialize``'s errors; a meta-device model from safetensors; and saves checkpoints.
World size 1 then reloads those checkpoints (saved by 2 ranks) and checks every weight.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flatzero.launch import run_ranks
from flatzero.models import build_model, save_model_safetensors
from tiny_configs import TINY_LLAMA

STEPS = 6
GAS = 2
MICRO = 2
SEQ = 12
LRS = (3e-3, 5e-3)
SCHED = {"total_num_steps": 8, "warmup_num_steps": 3, "warmup_max_lr": list(LRS)}  # per group


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu") -> nn.Module:
    model = build_model(TINY_LLAMA, device=device, dtype=dtype, seed=seed, tie_embeddings=True)
    model.model.layers[0].input_layernorm.weight.requires_grad_(False)
    return model


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two groups of params (not names): matrices with weight decay, the rest without."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in trainable if p.dim() >= 2], "lr": LRS[0], "weight_decay": 0.1},
        {"params": [p for p in trainable if p.dim() < 2], "lr": LRS[1], "weight_decay": 0.0},
    ]


def ds_config(stage: int, world_size: int, groups: int = 1, **extra: Any) -> dict[str, Any]:
    sched = SCHED if groups == 2 else {**SCHED, "warmup_max_lr": LRS[0]}
    return {
        "train_batch_size": MICRO * GAS * world_size,
        "train_micro_batch_size_per_gpu": MICRO,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000},
        "optimizer": {"type": "AdamW", "params": {"lr": LRS[0], "betas": [0.9, 0.95]}},
        "scheduler": {"type": "WarmupDecayLR", "params": sched},
        "gradient_clipping": 0.5,
        "steps_per_print": 3,
        "flatzero": {"progress": False},
        **extra,
    }


def data(world_size: int) -> torch.Tensor:
    """Token ids ``[step, micro, rank, batch, seq]``, the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(
        0, TINY_LLAMA.vocab_size, (STEPS, GAS, world_size, MICRO, SEQ), generator=g
    )


def train(engine, rank: int, world_size: int, steps: int = STEPS) -> list[float]:
    ids = data(world_size)
    losses = []
    for step in range(steps):
        for micro in range(GAS):
            batch = ids[step, micro, rank]
            loss = engine(batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


def reference(world_size: int) -> dict[str, torch.Tensor]:
    """Plain AdamW on one process over all ranks' micro-batches, same schedule."""
    from flatzero.deepspeed.engine import WarmupDecayLR

    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), betas=(0.9, 0.95))
    sched = WarmupDecayLR(opt, **SCHED)
    trainable = [p for p in model.parameters() if p.requires_grad]
    ids = data(world_size)
    for step in range(STEPS):
        for micro in range(GAS):
            for rank in range(world_size):
                batch = ids[step, micro, rank]
                (model(batch, labels=batch).loss / (GAS * world_size)).backward()
        torch.nn.utils.clip_grad_norm_(trainable, 0.5)
        opt.step()
        opt.zero_grad()
        sched.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def error_of(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


# --------------------------------------------------------------------- world size 2
def _parity(rank: int, ws: int, ckpt_root: Path) -> dict[str, Any]:
    import flatzero

    out: dict[str, Any] = {}
    ref = reference(ws) if rank == 0 else None
    for stage in (0, 1, 2):
        model = make_model()
        frozen_before = model.model.layers[0].input_layernorm.weight.detach().clone()
        engine, opt, loader, sched = flatzero.initialize(
            model=model, model_parameters=param_groups(model), config=ds_config(stage, ws, 2)
        )
        assert loader is None and sched is engine.lr_scheduler and opt is engine.optimizer
        assert engine.zero_optimization_stage() == stage
        losses = train(engine, rank, ws)
        assert engine.global_steps == STEPS and engine.micro_steps == STEPS * GAS
        assert engine.global_samples == STEPS * MICRO * GAS * ws
        assert sched.last_batch_iteration == STEPS - 1  # stepped once per optimizer step
        assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
        assert torch.equal(model.model.layers[0].input_layernorm.weight, frozen_before)
        full = opt.full_params()
        if rank == 0:
            assert ref is not None
            worst = max(rel_err(full[n], ref[n]) for n in full)
            assert worst < 1e-5, (stage, worst)
            params = dict(model.named_parameters())
            assert max(rel_err(params[n].detach(), ref[n]) for n in ref) < 1e-5
            out[f"stage{stage}_err"] = worst
        out[f"stage{stage}_losses"] = losses
        if stage != 1:  # checkpoints of a sharded (2) and a replicated (0) engine
            directory = ckpt_root / f"stage{stage}"
            assert engine.save_checkpoint(directory, client_state={"epoch": 3})
            assert (directory / "latest").read_text().strip() == f"global_step{STEPS}"
            if rank == 0:
                torch.save(
                    {"full": full, "lr": engine.get_lr(), "steps": engine.global_steps},
                    directory / "expected.pt",
                )
            # Load it back here (same world size) after more training: weights restored.
            train(engine, rank, ws, steps=1)
            path, client = engine.load_checkpoint(directory)
            assert client == {"epoch": 3} and path.endswith(f"global_step{STEPS}")
            assert engine.global_steps == STEPS
            back = opt.full_params()
            assert all(torch.equal(back[n], full[n]) for n in full)
        engine.destroy()
    return out


def _client_optimizer(rank: int, ws: int) -> None:
    import flatzero

    config = {k: v for k, v in ds_config(2, ws).items() if k not in ("optimizer", "scheduler")}
    # An instance (with its groups), and a scheduler built over it: both carried over.
    model = make_model()
    client = torch.optim.SGD(param_groups(model), momentum=0.9)
    step_lr = torch.optim.lr_scheduler.StepLR(client, step_size=2, gamma=0.5)
    engine, opt, _, sched = flatzero.initialize(
        model=model, optimizer=client, lr_scheduler=step_lr, config=config
    )
    assert type(opt.inner) is torch.optim.SGD and sched is step_lr and sched.optimizer is opt
    assert opt.param_groups[1]["lr"] == LRS[1] and opt.param_groups[0]["momentum"] == 0.9
    train(engine, rank, ws)
    assert engine.get_lr() == [LRS[0] * 0.125, LRS[1] * 0.125]  # 6 steps, halved every 2
    engine.destroy()
    # A function of the params, and a function of the optimizer.
    model = make_model()
    engine, opt, _, sched = flatzero.initialize(
        model=model,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
        config=config,
    )
    assert type(opt.inner) is torch.optim.Adam and sched.optimizer is opt
    # The client's fused=None/foreach=None chose nothing: the fused kernel (issue 23 item 10).
    assert opt.inner.param_groups[0]["fused"] is True
    train(engine, rank, ws, steps=2)
    assert engine.get_lr() == [pytest.approx(1e-3 / 3)]
    engine.destroy()


def _bf16_and_fp16(rank: int, ws: int) -> None:
    import flatzero

    # bf16 from an fp32 model: every trainable param is cast while it is flattened (a view
    # of its bf16 bucket, no fp32 copy left), frozen params too (as DeepSpeed's engine).
    model = make_model()
    engine, opt, _, _ = flatzero.initialize(
        model=model, config=ds_config(2, ws, bf16={"enabled": True})
    )
    buckets = [b for g in opt.flat.groups for b in g.buckets]
    assert all(b.dtype == torch.bfloat16 for b in buckets)
    for p in model.parameters():
        assert p.dtype == torch.bfloat16
        if p.requires_grad:
            start = p.untyped_storage().data_ptr()
            assert any(start == b.untyped_storage().data_ptr() for b in buckets)
    before = model.lm_head.weight.detach().clone()
    losses = train(engine, rank, ws)
    assert all(math.isfinite(x) for x in losses)
    assert not torch.equal(model.lm_head.weight, before)  # the bf16 params were updated
    assert engine.init_report.dtype == "bf16" and engine.init_report.source == "cpu float32"
    engine.destroy()

    # fp16: an inf loss on one rank skips the step on all, halves the scale, holds the lr.
    fp16 = {
        "enabled": True,
        "initial_scale_power": 8,
        "hysteresis": 1,
        "loss_scale_window": 1000,
    }
    model = make_model()
    config = ds_config(2, ws, fp16=fp16)
    engine, opt, _, sched = flatzero.initialize(model=model, config=config)
    ids = data(ws)
    applied = []
    for step in range(3):
        for micro in range(GAS):
            batch = ids[step, micro, rank]
            loss = engine(batch, labels=batch).loss
            if step == 1 and micro == 0 and rank == 1:
                loss = loss * math.inf
            engine.backward(loss)
            engine.step()
        applied.append(engine.was_step_applied())
    assert applied == [True, False, True]
    assert engine.skipped_steps == 1 and engine.global_steps == 3
    assert engine.loss_scale == 2.0**7
    assert sched.last_batch_iteration == 1  # not stepped on the skipped step
    engine.destroy()


def _boundary_and_sync(rank: int, ws: int) -> dict[str, str]:
    import flatzero

    # Ranks built with different seeds: 'gather' makes them equal (each rank's slice); on
    # host buffers at 2 ranks the sharded tier's own all-gather does it, in one pass.
    model = make_model(seed=rank)
    engine, *_ = flatzero.initialize(model=model, config=ds_config(1, ws))
    assert engine.init_report.param_sync == "the sharded tier's all-gather"
    assert engine.init_report.flatten.tiers == ("sharded",)
    reason = engine.init_report.flatten.tier_reason  # the door chose it: not "requested"
    assert "requested" not in reason and "param_sync: gather" in reason, reason
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(ws)]
    dist.all_gather(gathered, flat)
    assert torch.equal(gathered[0], gathered[1])
    # Boundaries: step() steps the optimizer every GAS calls only.
    ids = data(ws)
    boundary = []
    for micro in range(GAS * 2):
        batch = ids[0, micro % GAS, rank]
        engine.backward(engine(batch, labels=batch).loss)
        boundary.append(engine.is_gradient_accumulation_boundary())
        engine.zero_grad()  # mid-window: keeps the gradients (warned once)
        engine.step()
    assert boundary == [False, True, False, True] and engine.global_steps == 2
    errors = {"step_without_backward": "no error"}
    engine.step()  # micro step 5: not a boundary, nothing happens
    errors["step_without_backward"] = error_of(engine.step)
    engine.destroy()
    # 'check' refuses different weights on every rank.
    model = make_model(seed=rank)
    config = ds_config(1, ws, flatzero={"param_sync": "check", "progress": False})
    errors["check"] = error_of(lambda: flatzero.initialize(model=model, config=config))
    # Training data: a DataLoader over a DistributedSampler with the micro-batch size.
    model = make_model()
    dataset = torch.utils.data.TensorDataset(torch.arange(20))
    engine, _, loader, _ = flatzero.initialize(
        model=model, config=ds_config(2, ws), training_data=dataset
    )
    assert loader.batch_size == MICRO and len(loader) == 5
    assert isinstance(loader.sampler, torch.utils.data.DistributedSampler)
    engine.destroy()
    return errors


def _initialize_errors(rank: int, ws: int) -> dict[str, str]:
    import flatzero

    def init(**kwargs: Any):
        return lambda: flatzero.initialize(**kwargs)

    model = make_model()
    used = torch.optim.AdamW(model.parameters())
    model(
        torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)
    ).loss.backward()
    used.step()
    config = ds_config(2, ws)
    no_opt = {k: v for k, v in config.items() if k not in ("optimizer", "scheduler")}
    other = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    before = [p.data_ptr() for p in model.parameters()]
    errors = {
        "no_optimizer": error_of(init(model=model, config=no_opt)),
        "stepped_optimizer": error_of(init(model=model, optimizer=used, config=no_opt)),
        "foreign_scheduler": error_of(
            init(
                model=model,
                optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1),
                config=no_opt,
            )
        ),
        "bad_scheduler": error_of(
            init(
                model=model,
                config={
                    **config,
                    "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": [1.0, 2.0]}},
                },
            )
        ),
        "no_config": error_of(init(model=model)),
        "mpu": error_of(init(model=model, config=config, mpu=object())),
        "foreign_param": error_of(
            init(model=model, model_parameters=[nn.Parameter(torch.zeros(2))], config=config)
        ),
        "checkpoint_for_real_model": error_of(
            init(model=model, config=config, checkpoint="nowhere.safetensors")
        ),
    }
    meta = make_model(device="meta")
    errors["meta_without_checkpoint"] = error_of(init(model=meta, config=config))
    # Nothing was flattened by any of these.
    assert [p.data_ptr() for p in model.parameters()] == before
    return errors


def _meta_from_safetensors(rank: int, ws: int, root: Path) -> None:
    import flatzero

    source = make_model(seed=7)
    if rank == 0:
        save_model_safetensors(source, root / "weights.safetensors")
    dist.barrier()
    meta = build_model(TINY_LLAMA, device="meta", dtype=torch.float32, tie_embeddings=True)
    engine, *_ = flatzero.initialize(
        model=meta,
        config=ds_config(2, ws, bf16={"enabled": True}),
        checkpoint=root / "weights.safetensors",
    )
    assert engine.init_report.source == "meta+safetensors"
    expected = dict(source.named_parameters())
    for name, p in meta.named_parameters():
        assert p.device.type == "cpu" and p.dtype == torch.bfloat16
        assert torch.equal(p.detach(), expected[name].detach().bfloat16()), name
    train(engine, rank, ws, steps=2)
    engine.destroy()


def rank_main_2(rank: int, ws: int, root: str) -> dict[str, Any]:
    torch.manual_seed(0)
    root_path = Path(root)
    out = _parity(rank, ws, root_path)
    _client_optimizer(rank, ws)
    _bf16_and_fp16(rank, ws)
    out["boundary_errors"] = _boundary_and_sync(rank, ws)
    out["init_errors"] = _initialize_errors(rank, ws)
    _meta_from_safetensors(rank, ws, root_path)
    return out


# --------------------------------------------------------------------- world size 1
def rank_main_1(rank: int, ws: int, root: str) -> dict[str, Any]:
    import flatzero

    out: dict[str, Any] = {}
    for stage_dir in ("stage2", "stage0"):
        directory = Path(root) / stage_dir
        expected = torch.load(directory / "expected.pt")
        # A model built with another seed; the checkpoint was saved by 2 ranks.
        model = make_model(seed=5)
        engine, opt, _, _ = flatzero.initialize(
            model=model, model_parameters=param_groups(model), config=ds_config(2, 1, 2)
        )
        path, client = engine.load_checkpoint(directory)
        assert client == {"epoch": 3}
        assert engine.global_steps == expected["steps"] and engine.get_lr() == expected["lr"]
        full = opt.full_params()
        params = dict(model.named_parameters())
        for name, value in expected["full"].items():
            assert torch.equal(full[name], value), (stage_dir, name)
            assert torch.equal(params[name].detach(), value), (stage_dir, name)
        train(engine, 0, 1, steps=1)  # and training goes on
        engine.destroy()
        out[stage_dir] = path
    # A meta-device model straight from a flatzero checkpoint, into the buckets: the
    # model never gets storage of its own (no to_empty).
    meta = make_model(device="meta")
    to_empty = nn.Module.to_empty
    nn.Module.to_empty = lambda *a, **k: (_ for _ in ()).throw(AssertionError("to_empty"))
    try:
        engine, opt, _, _ = flatzero.initialize(
            model=meta,
            model_parameters=param_groups(meta),
            config=ds_config(2, 1, 2),
            checkpoint=Path(root) / "stage2",
        )
    finally:
        nn.Module.to_empty = to_empty
    expected = torch.load(Path(root) / "stage2" / "expected.pt")["full"]
    assert engine.init_report.source == "meta+flatzero checkpoint"
    assert all(torch.equal(p, expected[n]) for n, p in opt.full_params().items())
    buckets = {b.untyped_storage().data_ptr() for g in opt.flat.groups for b in g.buckets}
    for name, p in meta.named_parameters():
        assert p.device.type == "cpu", name  # frozen ones too
        if p.requires_grad:
            assert torch.equal(p.detach(), expected[name]), name
            assert p.untyped_storage().data_ptr() in buckets, name
    train(engine, 0, 1, steps=1)
    engine.destroy()
    # No checkpoint there: DeepSpeed's (None, None).
    model = make_model()
    engine, *_ = flatzero.initialize(model=model, config=ds_config(2, 1))
    out["missing"] = engine.load_checkpoint(Path(root) / "empty")
    report = engine.init_report
    out["report"] = report.summary()
    out["report_fields"] = (report.stage, report.dtype, report.world_size, report.tensors)
    engine.destroy()
    return out


EXPECTED_INIT_ERRORS = {
    "no_optimizer": "UnsupportedFeatureError: flatzero.initialize needs an optimizer: add an "
    "'optimizer' section to the config (e.g. {'type': 'AdamW', 'params': {'lr': 1e-4}}) or pass "
    "optimizer=",
    "stepped_optimizer": "ValueError: the AdamW passed as optimizer already has state (it has "
    "stepped); flatzero builds its own optimizer over the flat shards and cannot carry that "
    "state over: pass a fresh optimizer, and restore state with engine.load_checkpoint",
    "foreign_scheduler": "ValueError: lr_scheduler is an instance built over another optimizer "
    "than the one passed to flatzero.initialize; pass a function optimizer -> scheduler instead "
    "(lr_scheduler=lambda opt: torch.optim.lr_scheduler.X(opt, ...))",
    "bad_scheduler": "ValueError: config key 'scheduler' (WarmupLR with params {'warmup_max_lr': "
    "[1.0, 2.0]}) cannot be built: WarmupLR warmup_max_lr has 2 values but the optimizer has 1 "
    "param groups; give one value, or one per param group",
    "no_config": "ValueError: flatzero.initialize needs a DeepSpeed config: pass config=dict(...) "
    "or the path of a JSON file (or args with a deepspeed_config attribute)",
    "mpu": "UnsupportedFeatureError: mpu/mesh_param ask for model parallelism, which flatzero "
    "does not implement: flatzero is data parallel (ZeRO 0-2) only; drop them",
    "foreign_param": "ValueError: model_parameters item 0 (shape (2,)) is not a parameter of "
    "model; pass the model's own parameters",
    "checkpoint_for_real_model": "ValueError: checkpoint= is for models on the meta device; this "
    "model has its weights. Use engine.load_checkpoint(dir) to load a checkpoint into it",
    "meta_without_checkpoint": "ValueError: the model's params are on the meta device; pass "
    "checkpoint= (a safetensors file or directory, or a flatzero checkpoint) to load them from",
}


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    two = run_ranks(rank_main_2, 2, str(root))
    one = run_ranks(rank_main_1, 1, str(root))[0]
    return two, one


def test_parity_with_plain_adamw_at_stages_0_1_2(worlds):
    two, _ = worlds
    for stage in (0, 1, 2):
        assert two[0][f"stage{stage}_err"] < 1e-5
        losses = two[0][f"stage{stage}_losses"]
        assert losses[-1] < losses[0]
    # Stage 0, 1 and 2 are the same computation.
    assert two[0]["stage0_losses"] == pytest.approx(two[0]["stage2_losses"], rel=1e-5)


def test_boundary_and_weight_sync(worlds):
    two, _ = worlds
    for rank in range(2):
        errors = two[rank]["boundary_errors"]
        assert errors["step_without_backward"].startswith(
            "RuntimeError: ZeroOptimizer.step() was called but no backward pass reached the params"
        )
        assert errors["check"] == (
            "ValueError: the model's initial weights differ between ranks (flatzero.param_sync="
            "'check'); build the model with the same seed on every rank, or use "
            "param_sync='gather'"
        )


def test_initialize_errors(worlds):
    two, _ = worlds
    assert two[0]["init_errors"] == EXPECTED_INIT_ERRORS
    assert two[1]["init_errors"] == EXPECTED_INIT_ERRORS


def test_checkpoints_reload_at_world_size_1(worlds):
    _, one = worlds
    assert one["stage2"].endswith("stage2/global_step6")
    assert one["stage0"].endswith("stage0/global_step6")
    assert one["missing"] == (None, None)
    assert one["report_fields"] == (2, "fp32", 1, 19)
    assert "ZeRO stage 2, fp32, 1 rank," in one["report"]
