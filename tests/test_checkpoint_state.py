"""Checkpoint state in one process: optimizers other than AdamW, the fp16 loss scaler,
saving before the first step, weights-only loads, keep_last, overwrite, JSON values."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from torch import nn

from flatzero import FlattenConfig, flatten_parameters
from flatzero.checkpoint import (
    LoadConfig,
    SaveConfig,
    atomic,
    available_tags,
    load_checkpoint,
    load_flat_params,
    read_latest,
    save_checkpoint,
)
from flatzero.checkpoint.format import decode_value, encode_value
from flatzero.optim import ZeroOptimizer


class Net(nn.Module):
    def __init__(self, dtype=torch.float32) -> None:
        super().__init__()
        self.a = nn.Linear(7, 33).to(dtype)
        self.b = nn.Linear(33, 5).to(dtype)
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.b(torch.tanh(self.a(x.to(self.a.weight.dtype)))).float().pow(2).mean()


def make(optimizer=torch.optim.AdamW, dtype=torch.float32, bucket=200, seed=0, **kwargs):
    torch.manual_seed(seed)
    net = Net(dtype)
    opt = ZeroOptimizer(
        net.named_parameters(),
        optimizer,
        flatten_config=FlattenConfig(bucket_numel=bucket, progress=False),
        **kwargs,
    )
    return net, opt


def train(net, opt, steps: int, seed: int = 1) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        loss = net(torch.randn(4, 7, generator=g))
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize(
    ("optimizer", "kwargs"),
    [
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        (torch.optim.Adagrad, {"lr": 0.1}),
        (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
    ],
)
def test_other_optimizers_resume_exactly(tmp_path, optimizer, kwargs):
    net, opt = make(optimizer, **kwargs)
    train(net, opt, 3)
    save_checkpoint(tmp_path, opt, model=net)
    expected = train(net, opt, 3, seed=2)
    net2, opt2 = make(optimizer, bucket=90, seed=5, **kwargs)
    load_checkpoint(tmp_path, opt2, model=net2)
    assert int(net2.count) == 3  # buffer restored
    assert train(net2, opt2, 3, seed=2) == expected


def test_fp16_loss_scaler_is_restored(tmp_path):
    net, opt = make(dtype=torch.float16, lr=1e-3)
    train(net, opt, 2)
    opt._scaler.scale = 1024.0  # as if it had backed off
    opt._scaler.good_steps = 7
    save_checkpoint(tmp_path, opt)
    net2, opt2 = make(dtype=torch.float16, lr=1e-3, seed=3)
    load_checkpoint(tmp_path, opt2)
    assert opt2.loss_scale == 1024.0
    assert opt2.state_dict()["loss_scaler"]["good_steps"] == 7
    for a, b in zip(net.parameters(), net2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_save_before_the_first_step_and_weights_only_load(tmp_path):
    net, opt = make(lr=1e-2)
    save_checkpoint(tmp_path, opt, tag="init")  # no optimizer state yet
    train(net, opt, 2)
    save_checkpoint(tmp_path, opt, tag="later")
    _, opt2 = make(lr=1e-2, seed=4)
    result = load_checkpoint(tmp_path, opt2, "init")
    assert result.step is None and opt2.state_dict()["optimizer"]["state"] == {}
    net3, opt3 = make(lr=5e-2, seed=4)
    load_checkpoint(tmp_path, opt3, config=LoadConfig(load_optimizer_states=False))
    assert opt3.param_groups[0]["lr"] == 5e-2  # hyperparameters not restored either
    assert opt3.state_dict()["optimizer"]["state"] == {}
    for a, b in zip(net.parameters(), net3.parameters(), strict=True):
        assert torch.equal(a, b)


def test_scheduler_and_extra(tmp_path):
    net, opt = make(lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        train(net, opt, 1)
        sched.step()
    extra = {
        "epoch": 3,
        "best": math.inf,
        "pair": (1, 2.5),
        "t": torch.tensor(4, dtype=torch.int32),
    }
    save_checkpoint(tmp_path, opt, scheduler=sched, extra=extra)
    _, opt2 = make(lr=1e-2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    result = load_checkpoint(tmp_path, opt2, scheduler=sched2)
    assert sched2.state_dict() == sched.state_dict()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 5e-3
    assert result.extra["epoch"] == 3 and result.extra["best"] == math.inf
    assert result.extra["pair"] == (1, 2.5) and result.extra["t"].dtype == torch.int32
    plain = _save_plain(tmp_path)
    _, opt3 = make()
    with pytest.raises(ValueError, match="no scheduler state"):
        load_checkpoint(plain, opt3, scheduler=torch.optim.lr_scheduler.StepLR(opt3, 1))


def _save_plain(tmp_path):
    _, opt = make()
    return save_checkpoint(tmp_path / "plain", opt, tag="plain")


def test_unstorable_extra_is_an_error_before_writing(tmp_path):
    _, opt = make()
    with pytest.raises(TypeError, match=r"extra\['f'\] is a builtin_function"):
        save_checkpoint(tmp_path, opt, extra={"f": print})
    assert not tmp_path.joinpath("step0").exists()


def test_keep_last_and_overwrite(tmp_path):
    net, opt = make(lr=1e-2)
    for _ in range(4):
        train(net, opt, 1)
        save_checkpoint(tmp_path, opt, config=SaveConfig(keep_last=2))
    assert sorted(available_tags(tmp_path)) == ["step3", "step4"]
    assert read_latest(tmp_path) == "step4"
    train(net, opt, 1)
    save_checkpoint(tmp_path, opt, tag="step4", config=SaveConfig(overwrite=True))
    _, opt2 = make()
    assert load_checkpoint(tmp_path, opt2).step == 5
    atomic.wait_for_removals()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("how", ["prune", "overwrite"])
def test_a_save_does_not_wait_for_the_old_checkpoint_to_be_deleted(tmp_path, monkeypatch, how):
    """The checkpoint a save prunes or replaces leaves its tag at once (renamed to a
    ``.tmp-`` name) and is deleted in the background: the save returns while that deletion
    is held, the new checkpoint loads meanwhile, and once it ends nothing is left."""
    release, started = threading.Event(), threading.Event()
    rmtree = atomic.shutil.rmtree

    def held_rmtree(path, *args, **kwargs):
        started.set()
        assert release.wait(30)
        rmtree(path, *args, **kwargs)

    net, opt = make(lr=1e-2)
    train(net, opt, 1)
    save_checkpoint(tmp_path, opt, tag="a")
    monkeypatch.setattr(atomic.shutil, "rmtree", held_rmtree)
    train(net, opt, 1)
    if how == "prune":
        save_checkpoint(tmp_path, opt, tag="b", config=SaveConfig(keep_last=1))
        assert sorted(available_tags(tmp_path)) == ["b"]
    else:
        save_checkpoint(tmp_path, opt, tag="a", config=SaveConfig(overwrite=True))
        assert sorted(available_tags(tmp_path)) == ["a"]
    assert started.wait(30)
    doomed = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert len(doomed) == 1 and doomed[0].is_dir()  # held: still there
    _, opt2 = make()
    assert load_checkpoint(tmp_path, opt2).step == 2
    release.set()
    atomic.wait_for_removals()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_load_flat_params_without_an_optimizer(tmp_path):
    net, opt = make(lr=1e-2)
    train(net, opt, 2)
    save_checkpoint(tmp_path, opt)
    fresh = Net()
    flat = flatten_parameters(fresh, config=FlattenConfig(bucket_numel=64, progress=False))
    load_flat_params(flat, tmp_path)
    for a, b in zip(net.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(
        flat.groups[0].master, torch.cat([b.float() for b in flat.groups[0].buckets])
    )


def test_json_values_round_trip():
    value = {"a": (1, [2.0, -math.inf]), 3: None, "d": torch.bfloat16, "n": math.nan}
    out = decode_value(encode_value(value))
    assert out["a"] == (1, [2.0, -math.inf]) and out[3] is None and out["d"] is torch.bfloat16
    assert math.isnan(out["n"])


def test_a_checkpoint_without_a_loss_scaler_loads_under_a_fixed_scale(tmp_path):
    """fp32 checkpoints and state dicts written before the door checked fp32 steps for
    inf/nan (a fixed scale of 1, as DeepSpeed's ZeRO-1/2) have no loss scaler state; they
    still load, through either path."""
    from flatzero.optim import LossScaleConfig, ZeroConfig

    net, opt = make(lr=1e-2)
    train(net, opt, 2)
    save_checkpoint(tmp_path, opt)
    state = opt.state_dict()
    assert state["loss_scaler"] is None
    fixed = ZeroConfig(loss_scale=LossScaleConfig(init_scale=1.0, dynamic=False))
    for load in (lambda o: load_checkpoint(tmp_path, o), lambda o: o.load_state_dict(state)):
        net2, opt2 = make(lr=1e-2, seed=3, config=fixed)
        load(opt2)
        assert opt2.loss_scale == 1.0
        for a, b in zip(net.parameters(), net2.parameters(), strict=True):
            assert torch.equal(a, b)
