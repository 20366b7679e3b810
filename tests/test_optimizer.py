"""ZeroOptimizer on one process: API, optimizer classes, schedulers, state, errors."""

from __future__ import annotations

import copy
import functools
import gc
import logging

import pytest
import torch
from torch import nn

from flatzero import FlattenConfig
from flatzero.launch import run_ranks
from flatzero.optim import LossScaleConfig, ZeroConfig, ZeroOptimizer

FLAT = FlattenConfig(bucket_numel=300, device="cpu", progress=False)


class Net(nn.Module):
    """Small MLP with a bias-free layer, a norm-like vector and a param used on demand."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4, bias=False)
        self.scale = nn.Parameter(torch.ones(4))
        self.unused = nn.Parameter(torch.full((5,), 0.5))
        self.to(dtype)

    def forward(self, x: torch.Tensor, use_unused: bool = False) -> torch.Tensor:
        y = self.b(torch.tanh(self.a(x))) * self.scale
        if use_unused:
            y = y + self.unused.sum()
        return y


def loss_fn(model: nn.Module, x: torch.Tensor, **kw) -> torch.Tensor:
    return model(x, **kw).float().pow(2).mean()


def snapshot(opt: ZeroOptimizer) -> torch.Tensor:
    parts = [b.float() for g in opt.flat.groups for b in g.buckets] + opt.master_shards
    return torch.cat(parts).clone()


def train_pair(opt_cls, stage: int, steps: int = 6, **kw):
    """ZeroOptimizer and the plain torch optimizer on copies of one model."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = ZeroOptimizer(model.parameters(), opt_cls, stage=stage, flatten_config=FLAT, **kw)
    ref_opt = opt_cls(ref.parameters(), **kw)
    for step in range(steps):
        x = torch.randn(6, 8)
        use = step % 2 == 0
        loss_fn(model, x, use_unused=use).backward()
        opt.step()
        opt.zero_grad()
        loss_fn(ref, x, use_unused=use).backward()
        for p in ref.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        ref_opt.step()
        ref_opt.zero_grad()
    return model, ref, opt


# ----------------------------------------------------------------- optimizer classes
ELEMENTWISE = [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
    (torch.optim.Adagrad, {"lr": 0.1}),
    (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.5}),
    (torch.optim.Adamax, {"lr": 1e-2}),
    (torch.optim.NAdam, {"lr": 1e-2}),
    (torch.optim.RAdam, {"lr": 1e-2}),
    (torch.optim.Adadelta, {"lr": 1.0}),
    (torch.optim.Rprop, {"lr": 1e-2}),
    (torch.optim.ASGD, {"lr": 1e-2}),
]


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize(("opt_cls", "kw"), ELEMENTWISE, ids=lambda v: getattr(v, "__name__", ""))
def test_elementwise_optimizers_match_torch(opt_cls, kw, stage):
    model, ref, _ = train_pair(opt_cls, stage, **kw)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_fused_adamw_on_the_flat_shard():
    model, ref, opt = train_pair(torch.optim.AdamW, 2, lr=1e-2, fused=True)
    assert opt.inner.defaults["fused"]
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_fused_kernels_take_the_clip_factor_as_grad_scale():
    from flatzero.optim.inner import takes_grad_scale

    results = []
    for kw in ({}, {"fused": False}):
        torch.manual_seed(0)
        model = Net()
        opt = ZeroOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            config=ZeroConfig(max_grad_norm=0.05),
            flatten_config=FLAT,
            lr=1e-2,
            **kw,
        )
        assert takes_grad_scale(opt.inner) == (not kw)
        for _ in range(3):
            loss_fn(model, torch.randn(4, 8)).backward()
            opt.step()
            assert getattr(opt.inner, "grad_scale", None) is None
        results.append([p.detach().clone() for p in model.parameters()])
    for p, q in zip(*results, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_client_adamw_keeps_fused():
    """``fused=None``/``foreach=None`` (a client ``torch.optim.AdamW(params, lr=...)``'s
    groups and defaults carry both) choose nothing: the fused kernel is used. A value is a
    choice and is kept."""
    from flatzero.optim.inner import takes_grad_scale

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    client = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert client.param_groups[0]["fused"] is None and client.param_groups[0]["foreach"] is None
    opt = ZeroOptimizer(client.param_groups, torch.optim.AdamW, flatten_config=FLAT)
    assert [g["fused"] for g in opt.inner.param_groups] == [True]
    assert takes_grad_scale(opt.inner)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(3):
        x = torch.randn(6, 8)
        loss_fn(model, x, use_unused=True).backward()
        opt.step()
        loss_fn(ref, x, use_unused=True).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    opt.close()

    opt = ZeroOptimizer(
        Net().parameters(),
        torch.optim.AdamW,
        flatten_config=FLAT,
        lr=1e-2,
        fused=None,
        foreach=None,
    )
    assert opt.inner.param_groups[0]["fused"] is True
    opt.close()
    for choice in ({"foreach": True}, {"fused": False}):
        opt = ZeroOptimizer(
            [{"params": Net().parameters(), **choice}], torch.optim.AdamW, flatten_config=FLAT
        )
        group = opt.inner.param_groups[0]
        assert not group["fused"] and group["foreach"] is choice.get("foreach"), choice
        assert not takes_grad_scale(opt.inner)
        opt.close()


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("LBFGS", "closure"),
        ("SparseAdam", "sparse"),
    ],
)
def test_optimizers_that_need_shapes_are_refused_before_anything_changes(name, reason):
    if not hasattr(torch.optim, name):
        pytest.skip(f"torch.optim.{name} does not exist in this torch")
    model = Net()
    ptrs = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(TypeError, match=f"{name} cannot be used with ZeroOptimizer.*{reason}"):
        ZeroOptimizer(model.parameters(), getattr(torch.optim, name))
    assert ptrs == [p.data_ptr() for p in model.parameters()]


def test_instances_unknown_classes_and_bad_arguments_are_refused():
    model = Net()
    ptrs = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(TypeError, match="pass the class"):
        ZeroOptimizer(model.parameters(), torch.optim.AdamW(model.parameters()))
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer subclass"):
        ZeroOptimizer(model.parameters(), "adamw")

    class MyAdam(torch.optim.Adam):
        pass

    with pytest.raises(TypeError, match="elementwise_optimizer=True"):
        ZeroOptimizer(model.parameters(), MyAdam)
    with pytest.raises(TypeError, match="betaz"):
        ZeroOptimizer(model.parameters(), torch.optim.AdamW, betaz=(0.9, 0.9))
    with pytest.raises(ValueError, match="Invalid learning rate"):
        ZeroOptimizer([{"params": list(model.parameters())}], torch.optim.AdamW, lr=-1.0)
    assert ptrs == [p.data_ptr() for p in model.parameters()]
    opt = ZeroOptimizer(model.parameters(), MyAdam, elementwise_optimizer=True, flatten_config=FLAT)
    assert isinstance(opt.inner, MyAdam)


def test_partial_of_an_optimizer_class_is_accepted():
    model = Net()
    opt = ZeroOptimizer(
        model.parameters(), functools.partial(torch.optim.SGD, momentum=0.9), lr=0.1
    )
    assert opt.param_groups[0]["momentum"] == 0.9 and opt.param_groups[0]["lr"] == 0.1


# ---------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stage": 3}, "stage 1 and 2"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"max_grad_norm": float("nan")}, "max_grad_norm"),
        ({"reduce_dtype": torch.int32}, "reduce_dtype"),
        ({"staging_buffers": 0}, "staging_buffers"),
    ],
)
def test_zero_config_is_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"init_scale": 0.0}, "init_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.5}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"init_scale": 0.5, "min_scale": 1.0}, "min_scale <= init_scale"),
    ],
)
def test_loss_scale_config_is_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScaleConfig(**kwargs)


def test_stage_argument_overrides_config():
    opt = ZeroOptimizer(Net().parameters(), stage=1, config=ZeroConfig(max_grad_norm=1.0))
    assert opt.stage == 1 and opt.config.max_grad_norm == 1.0


# -------------------------------------------------------------------- torch.optim face
def test_param_groups_keep_per_group_options_and_lr_schedulers_work(recwarn):
    model = Net()
    opt = ZeroOptimizer(
        [
            {"params": [model.a.weight, model.b.weight], "lr": 0.1, "weight_decay": 0.01},
            {"params": [model.a.bias, model.scale, model.unused], "lr": 0.2, "weight_decay": 0},
        ],
        torch.optim.AdamW,
        flatten_config=FLAT,
        betas=(0.8, 0.9),
    )
    assert isinstance(opt, torch.optim.Optimizer)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.2]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0]
    assert all(g["betas"] == (0.8, 0.9) for g in opt.param_groups)
    assert opt.param_groups is opt.inner.param_groups
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    for _ in range(3):
        loss_fn(model, torch.randn(4, 8)).backward()
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1 / 8, 0.2 / 8])
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]
    opt.param_groups[1]["lr"] = 0.0  # set by hand, as users do
    before = opt.master_shards[1].clone()
    loss_fn(model, torch.randn(4, 8), use_unused=True).backward()
    opt.step()
    assert torch.equal(opt.master_shards[1], before)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    assert cosine.get_last_lr()[0] == pytest.approx(opt.param_groups[0]["lr"])
    with pytest.raises(NotImplementedError, match="add a param group"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


def test_step_pre_and_post_hooks_run():
    opt = ZeroOptimizer(Net().parameters(), flatten_config=FLAT)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    loss_fn(opt_model := Net(), torch.randn(2, 8)).backward()  # another model: no grads here
    del opt_model
    with pytest.raises(RuntimeError):
        opt.step()
    assert calls == ["pre"]


def test_closure_is_called_and_its_loss_returned():
    model = Net()
    opt = ZeroOptimizer(model.parameters(), flatten_config=FLAT)
    x = torch.randn(4, 8)

    def closure():
        opt.zero_grad()
        loss = loss_fn(model, x)
        loss.backward()
        return loss

    assert opt.step(closure).item() == pytest.approx(
        loss_fn(copy.deepcopy(model), x).item(), rel=0.5
    )


# ---------------------------------------------------------------- gradient semantics
@pytest.mark.parametrize("stage", [1, 2])
def test_step_without_backward_is_an_error_and_changes_nothing(stage):
    model = Net()
    opt = ZeroOptimizer(model.parameters(), stage=stage, flatten_config=FLAT)
    before = snapshot(opt)
    with pytest.raises(RuntimeError, match="no backward pass"):
        opt.step()
    assert torch.equal(before, snapshot(opt))
    loss_fn(model, torch.randn(3, 8)).backward()
    opt.step()
    after = snapshot(opt)
    assert not torch.equal(before, after)
    with pytest.raises(RuntimeError, match="no backward pass"):
        opt.step()  # step() ended the window
    assert torch.equal(after, snapshot(opt))


@pytest.mark.parametrize("stage", [1, 2])
def test_accumulation_sums_micro_batches_and_zero_grad_drops_them(stage):
    torch.manual_seed(1)
    xs = [torch.randn(4, 8) for _ in range(3)]
    model = Net()
    ref = copy.deepcopy(model)
    opt = ZeroOptimizer(
        model.parameters(), torch.optim.SGD, stage=stage, flatten_config=FLAT, lr=0.1
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    loss_fn(model, torch.randn(4, 8) * 100).backward()  # dropped by zero_grad
    opt.zero_grad(set_to_none=False)
    for x in xs:
        (loss_fn(model, x, use_unused=x is xs[1]) / 3).backward()
        (loss_fn(ref, x, use_unused=x is xs[1]) / 3).backward()
    opt.step()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_stage2_params_hold_no_grad_and_stage1_grads_are_views_of_one_buffer():
    model = Net(torch.bfloat16)
    opt = ZeroOptimizer(model.parameters(), stage=2, flatten_config=FLAT)
    loss_fn(model, torch.randn(3, 8).bfloat16(), use_unused=True).backward()
    assert all(p.grad is None for p in model.parameters())
    assert opt.flat_grad_buffers == []
    assert opt.gradient_bytes() == sum(g.nbytes for g in opt.grad_shards)  # no staging at 1

    model = Net()
    opt = ZeroOptimizer(model.parameters(), stage=2, flatten_config=FLAT)
    loss_fn(model, torch.randn(3, 8), use_unused=True).backward()
    assert all(p.grad is None for p in model.parameters())
    assert opt.gradient_bytes() == sum(g.nbytes for g in opt.grad_shards)

    model = Net()
    opt = ZeroOptimizer(model.parameters(), stage=1, flatten_config=FLAT)
    (buffer,) = opt.flat_grad_buffers
    loss_fn(model, torch.randn(3, 8)).backward()
    for p in model.parameters():
        assert p.grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    grad = model.a.weight.grad.clone()
    assert torch.count_nonzero(grad)
    model.zero_grad()  # the module's zero_grad sets .grad to None...
    loss_fn(model, torch.randn(3, 8)).backward()
    assert model.a.weight.grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert opt.gradient_bytes() == buffer.nbytes  # at world size 1 the buffer is the shard


def test_failed_backward_is_reported_and_zero_grad_recovers():
    model = Net(torch.bfloat16)  # bf16: stage 2 proper (fp32 at world size 1 runs in place)
    opt = ZeroOptimizer(
        model.parameters(), stage=2, flatten_config=FlattenConfig(device="cpu", progress=False)
    )

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("boom")

    x = torch.randn(3, 8).bfloat16()
    out = model.b(torch.tanh(model.a(x))) * model.scale
    loss = (out.sum() + Boom.apply(model.a(x)).sum()) + model.unused.sum()
    with pytest.raises(RuntimeError, match="boom"):
        loss.backward()
    with pytest.raises(RuntimeError, match="did not finish"):
        opt.step()
    opt.zero_grad()
    loss_fn(model, x).backward()
    opt.step()


def test_padding_stays_zero_with_weight_decay():
    model = Net()
    opt = ZeroOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        flatten_config=FlattenConfig(bucket_numel=100, alignment=64, device="cpu", progress=False),
        weight_decay=0.5,
    )
    for _ in range(3):
        loss_fn(model, torch.randn(3, 8), use_unused=True).backward()
        opt.step()
    for group, master, grad in zip(
        opt.flat.groups, opt.master_shards, opt.grad_shards, strict=True
    ):
        for b, buffer in enumerate(group.buckets):
            for start, end in group.layout.gaps(b):
                assert not buffer[start:end].any()
            lo, hi = group.layout.buckets[b].rank_range(0)
            shard = group.layout.buckets[b].shard_offset
            for start, end in group.layout.gaps(b, lo, hi):
                assert not master[shard + start - lo : shard + end - lo].any()
                assert not grad[shard + start - lo : shard + end - lo].any()


def test_clip_grad_norm_matches_torch():
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = ZeroOptimizer(model.parameters(), torch.optim.SGD, flatten_config=FLAT, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    x = torch.randn(5, 8) * 3
    loss_fn(model, x).backward()
    loss_fn(ref, x).backward()
    ref.unused.grad = torch.zeros_like(ref.unused)
    norm = opt.clip_grad_norm_(0.1)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    torch.testing.assert_close(norm, ref_norm)
    assert norm > 0.1
    opt.step()
    ref_opt.step()
    assert opt.last_grad_norm == pytest.approx(float(ref_norm), rel=1e-6)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="L2 norm"):
        opt.clip_grad_norm_(1.0, norm_type=1.0)


def _torch_clip_rank(rank: int, world_size: int, stage: int, how: str) -> dict:
    """Two ranks, different data each; the loop clips the way ``how`` says."""
    torch.manual_seed(0)
    model = Net()
    opt = ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=stage, flatten_config=FLAT,
                        lr=0.5)  # fmt: skip
    norms = []
    for step in range(2):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(10 * step + rank)) * 3
        loss_fn(model, x).backward()
        if how == "torch":  # what every PyTorch loop writes
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)))
        elif how == "flatzero":
            norms.append(float(opt.clip_grad_norm_(0.1)))
        opt.step()
        opt.zero_grad()
    return {"norms": norms, "params": [p.detach().flatten().tolist() for p in model.parameters()]}


@pytest.mark.parametrize("stage", [1, 2])
def test_torchs_clip_grad_norm_clips_through_the_optimizer(stage, caplog):
    """``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` between backward and step
    (at stage 2 the params hold no ``.grad``; at stage 1 each rank's is its own) clips the
    global averaged gradient, as ``opt.clip_grad_norm_`` does, and returns its norm."""
    torch_way = run_ranks(_torch_clip_rank, 2, stage, "torch")
    direct = run_ranks(_torch_clip_rank, 2, stage, "flatzero")
    unclipped = run_ranks(_torch_clip_rank, 2, stage, "none")
    for r in range(2):
        assert torch_way[r]["norms"] == direct[r]["norms"] and min(direct[r]["norms"]) > 0.1
        assert torch_way[r]["params"] == direct[r]["params"]  # bit for bit
    assert torch_way[0]["params"] != unclipped[0]["params"]


def test_torchs_clip_grad_norm_is_torchs_own_for_other_params(caplog):
    torch.manual_seed(0)
    model, other = Net(), Net()
    ZeroOptimizer(model.parameters(), torch.optim.SGD, flatten_config=FLAT, lr=0.5)
    loss_fn(other, torch.randn(5, 8) * 3).backward()
    other.unused.grad = torch.zeros_like(other.unused)
    expected = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad) for p in other.parameters()])
    )
    with caplog.at_level(logging.WARNING):
        norm = torch.nn.utils.clip_grad_norm_(other.parameters(), 0.1)
    torch.testing.assert_close(norm, expected)
    assert "clipped through opt.clip_grad_norm_" not in caplog.text
    mixed = [*model.parameters(), *other.parameters()]  # not all flatzero's: torch's own
    torch.nn.utils.clip_grad_norm_(mixed, 1e9)


def test_fp16_turns_loss_scaling_on_and_bf16_does_not():
    assert ZeroOptimizer(Net(torch.float16).parameters(), flatten_config=FLAT).loss_scale == 2**16
    opt = ZeroOptimizer(Net(torch.bfloat16).parameters(), flatten_config=FLAT)
    loss = torch.tensor(3.0)
    assert opt.loss_scale == 1.0 and opt.scale_loss(loss) is loss


def test_fp16_overflow_skips_the_step_and_backs_off(caplog):
    model = Net(torch.float16)
    opt = ZeroOptimizer(
        model.parameters(),
        flatten_config=FLAT,
        config=ZeroConfig(
            loss_scale=LossScaleConfig(init_scale=8.0, growth_interval=2, hysteresis=2)
        ),
    )
    x = torch.randn(3, 8).half()
    before = snapshot(opt)
    with caplog.at_level(logging.INFO, logger="flatzero.optim.scaler"):
        for expected_scale in (8.0, 8.0, 4.0):  # hysteresis 2: the second overflow backs off
            assert opt.loss_scale == expected_scale
            opt.backward(loss_fn(model, x) * float("inf"))
            opt.step()
            assert opt.last_step_skipped and torch.equal(before, snapshot(opt))
    assert "step skipped" in caplog.text
    assert opt.loss_scale == 4.0
    for expected in (4.0, 4.0, 8.0, 8.0):  # grows after 2 clean steps
        assert opt.loss_scale == expected
        opt.backward(loss_fn(model, x))
        opt.step()
        assert not opt.last_step_skipped
    state = opt.state_dict()["loss_scaler"]
    assert state["skipped_steps"] == 3 and state["scale"] == 16.0


# ---------------------------------------------------------------- reading and state
def test_full_param_reads_fp32_masters_by_name():
    model = Net(torch.bfloat16)
    model.b.weight.requires_grad_(False)
    opt = ZeroOptimizer(model.named_parameters(), flatten_config=FLAT)
    loss_fn(model, torch.randn(3, 8).bfloat16()).backward()
    opt.step()
    value = opt.full_param("a.weight")
    assert value.dtype == torch.float32 and value.shape == (16, 8)
    assert torch.equal(value.bfloat16(), model.a.weight)
    full = opt.full_params()
    assert set(full) == {"a.weight", "a.bias", "scale", "unused"}
    assert torch.equal(full["a.weight"], value)
    with pytest.raises(ValueError, match=r"'b\.weight'.*frozen"):
        opt.full_param("b.weight")


def _deep_copy_state(state: dict) -> dict:
    return copy.deepcopy(state)


@pytest.mark.parametrize("stage", [1, 2])
def test_state_dict_round_trip_resumes_the_same_trajectory(stage):
    torch.manual_seed(0)
    xs = [torch.randn(4, 8) for _ in range(5)]

    def make():
        torch.manual_seed(3)
        model = Net()
        opt = ZeroOptimizer(
            model.parameters(),
            stage=stage,
            flatten_config=FLAT,
            config=ZeroConfig(max_grad_norm=1.0),
            lr=1e-2,
        )
        return model, opt

    def run(model, opt, batch):
        for x in batch:
            loss_fn(model, x, use_unused=True).backward()
            opt.step()

    a, opt_a = make()
    run(a, opt_a, xs[:3])
    saved = _deep_copy_state(opt_a.state_dict())
    assert saved["format"] == "flatzero.ZeroOptimizer/1" and saved["world_size"] == 1
    run(a, opt_a, xs[3:])
    b, opt_b = make()
    opt_b.param_groups[0]["lr"] = 123.0
    opt_b.load_state_dict(saved)
    assert opt_b.param_groups[0]["lr"] == 1e-2
    assert opt_b.param_groups is opt_b.inner.param_groups
    run(b, opt_b, xs[3:])
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_load_state_dict_refuses_other_layouts_and_changes_nothing():
    model = Net()
    opt = ZeroOptimizer(model.parameters(), flatten_config=FLAT)
    loss_fn(model, torch.randn(2, 8)).backward()
    opt.step()
    good = _deep_copy_state(opt.state_dict())
    other = ZeroOptimizer(
        Net().parameters(),
        flatten_config=FlattenConfig(bucket_numel=50, device="cpu", progress=False),
    )
    before = snapshot(other)
    with pytest.raises(ValueError, match="another layout"):
        other.load_state_dict(good)
    assert torch.equal(before, snapshot(other))

    before = snapshot(opt)
    state_before = copy.deepcopy(opt.inner.state_dict())
    bad_cases = {
        "not a ZeroOptimizer state dict": {"format": "x"},
        "rank 3's shard": {**good, "rank": 3},
        "master shard 0": {**good, "master": [torch.zeros(7)]},
        "exp_avg": {
            **good,
            "optimizer": {
                **good["optimizer"],
                "state": {0: {**good["optimizer"]["state"][0], "exp_avg": torch.zeros(3)}},
            },
        },
    }
    for match, bad in bad_cases.items():
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(bad)
        assert torch.equal(before, snapshot(opt))
    after = opt.inner.state_dict()
    for key, value in state_before["state"][0].items():
        assert torch.equal(after["state"][0][key], value)


def test_close_removes_the_hooks():
    model = Net(torch.bfloat16)
    opt = ZeroOptimizer(model.parameters(), stage=2, flatten_config=FLAT)
    opt.close()
    loss_fn(model, torch.randn(2, 8).bfloat16()).backward()
    assert model.a.weight.grad is not None


def test_one_param_cannot_have_two_live_optimizers():
    model = Net(torch.bfloat16)
    x = torch.randn(2, 8).bfloat16()
    first = ZeroOptimizer(model.parameters(), stage=2, flatten_config=FLAT)
    ptrs = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ValueError, match="already managed by another ZeroOptimizer"):
        ZeroOptimizer(model.parameters(), stage=2, flatten_config=FLAT)
    assert ptrs == [p.data_ptr() for p in model.parameters()]
    first.close()
    second = ZeroOptimizer(model.parameters(), stage=2, flatten_config=FLAT)
    del second
    gc.collect()  # a collected optimizer lets go of the params and removes its hooks
    third = ZeroOptimizer(model.parameters(), stage=2, flatten_config=FLAT)
    loss_fn(model, x).backward()
    third.step()
    assert not third.last_step_skipped and all(p.grad is None for p in model.parameters())
