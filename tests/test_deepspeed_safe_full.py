"""``deepspeed.utils.safe_get_full_*`` / ``safe_set_full_*`` on flatzero's engine, and the
internals of DeepSpeed's optimizer that scripts read (``engine.optimizer.optimizer``,
``loss_scaler.cur_scale``, ``cur_scale``), side by side with DeepSpeed 0.19.8's ZeRO-1/2 (CPU,
gloo, 2 ranks, a param split between the ranks; skipped without DeepSpeed)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from flatzero.launch import run_ranks

KEYS = ("exp_avg", "exp_avg_sq")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.Tanh(), torch.nn.Linear(20, 3))


def _config(stage: int, dtype: str) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
        "gradient_clipping": 0.0,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 4}
    return config


def _backward(engine: Any, rank: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(100 * seed + rank)
    x = torch.randn(4, 12, generator=gen).to(next(engine.module.parameters()).dtype)
    engine.backward(engine(x).float().pow(2).mean())


def _train(engine: Any, rank: int) -> dict[str, Any]:
    """Read, write and step through DeepSpeed's functions; every value as a list."""
    from deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_grad,
        safe_set_full_optimizer_state,
    )

    params = list(engine.module.named_parameters())
    out: dict[str, Any] = {}
    _backward(engine, rank, 0)
    out["grad"] = {n: safe_get_full_grad(p).tolist() for n, p in params}
    out["param"] = {n: safe_get_full_fp32_param(p).tolist() for n, p in params}
    engine.step()
    for key in KEYS:
        out[key] = {n: safe_get_full_optimizer_state(p, key).tolist() for n, p in params}
    # Write every kind of value, read it back, and step with what was written.
    written = {}
    for i, (n, p) in enumerate(params):
        value = torch.linspace(-1, 1, p.numel()).view(p.shape) * (i + 1)
        safe_set_full_fp32_param(p, value)
        safe_set_full_optimizer_state(p, value.abs() * 0.01, "exp_avg")
        safe_set_full_optimizer_state(p, value.abs() * 0.001, "exp_avg_sq")
        written[n] = [
            safe_get_full_fp32_param(p).tolist(),
            safe_get_full_optimizer_state(p, "exp_avg").tolist(),
        ]
    out["written"] = written
    _backward(engine, rank, 1)
    p0 = params[0][1]
    safe_set_full_grad(p0, torch.full(p0.shape, 0.25))
    out["grad written"] = safe_get_full_grad(p0).tolist()
    engine.step()
    out["after step"] = {n: safe_get_full_fp32_param(p).tolist() for n, p in params}
    # An inf gradient written before the step makes the step skip (bf16, fp16).
    _backward(engine, rank, 2)
    grad = torch.zeros(p0.shape)
    grad.view(-1)[3] = float("inf")
    safe_set_full_grad(p0, grad)
    engine.step()
    out["skipped"] = engine.skipped_steps
    out["after inf"] = {n: safe_get_full_fp32_param(p).tolist() for n, p in params}
    return out


def _rank(rank: int, world_size: int, cases: list[tuple[int, str]]) -> dict[str, Any]:
    from flatzero.testing.deepspeed import prepare_deepspeed

    prepare_deepspeed()
    return {f"{stage} {dtype}": _case(rank, stage, dtype) for stage, dtype in cases}


def _case(rank: int, stage: int, dtype: str) -> dict[str, Any]:
    import deepspeed

    import flatzero
    from flatzero.testing.deepspeed import release_engine

    out: dict[str, Any] = {}
    for name, initialize in (
        ("deepspeed", deepspeed.initialize),
        ("flatzero", flatzero.initialize),
    ):
        model = _model()
        if dtype == "bf16":
            model = model.to(torch.bfloat16)
        engine, *_ = initialize(model=model, config=_config(stage, dtype))
        if name == "flatzero":  # the first Linear's weight lies in both ranks' shards
            layout = engine.optimizer.flat.groups[0].layout
            out["split"] = any(len({r for r, _ in layout.param_pieces(s)}) == 2
                               for s in range(len(layout.slots)))  # fmt: skip
        out[name] = _train(engine, rank)
        inner = engine.optimizer.optimizer  # the wrapped torch optimizer
        out[name]["internals"] = (
            type(inner).__name__,
            inner.param_groups[0]["lr"],
            sorted(inner.state[inner.param_groups[0]["params"][0]]),
            engine.optimizer.loss_scaler.cur_scale,
            engine.optimizer.cur_scale,
        )
        frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
        out[name]["unknown param"] = deepspeed.utils.safe_get_full_fp32_param(frozen)
        if name == "deepspeed":
            release_engine(engine)
        else:
            engine.destroy()
    return out


def _close(a: Any, b: Any, tol: float) -> None:
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    torch.testing.assert_close(ta, tb, rtol=tol, atol=tol, equal_nan=True)


CASES = [(1, "bf16"), (2, "bf16"), (2, "fp32")]
"""(stage, dtype); DeepSpeed refuses fp16 on the CPU accelerator."""


def test_safe_get_and_set_full_values_match_deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    outs = run_ranks(_rank, 2, CASES, env={"DS_ACCELERATOR": "cpu"})
    for stage, dtype in CASES:
        _compare([out[f"{stage} {dtype}"] for out in outs], dtype)


def _compare(outs: list[dict[str, Any]], dtype: str) -> None:
    assert outs[0]["split"]
    tol = 2e-2 if dtype != "fp32" else 1e-5
    for out in outs:
        ds, fz = out["deepspeed"], out["flatzero"]
        assert fz["unknown param"] is None and ds["unknown param"] is None
        for key in ("grad", "param", *KEYS, "after step", "after inf"):
            for name in ds[key]:
                _close(fz[key][name], ds[key][name], tol)
        for name, (param, avg) in fz["written"].items():
            _close(param, ds["written"][name][0], 0.0)  # written exactly, read back whole
            _close(avg, ds["written"][name][1], 0.0)
        _close(fz["grad written"], ds["grad written"], 0.0)
        assert fz["internals"] == ds["internals"]
        assert fz["skipped"] == ds["skipped"] == 1  # the inf gradient skipped the step
        assert fz["after inf"] == fz["after step"]  # (in fp32 too, as DeepSpeed's ZeRO-1/2)
