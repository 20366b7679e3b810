"""Ranks that disagree (config, checkpoint to load, checkpoint directory) get the same
clear error on every rank, in bounded time, with nothing written or changed (issue 29).

One launch at world size 2 runs the whole table; each case gives rank 1 a different input.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from flatzero.launch import run_ranks

_BOUND_S = 20.0
"""Seconds one case may take on a rank (a hang would take the collective timeout)."""


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _config(**extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "flatzero": {"progress": False},
        **extra,
    }


def _init(config: dict[str, Any]) -> Any:
    import flatzero

    return flatzero.initialize(model=_model(), config=config)[0]


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _case_config(rank: int, root: Path, changed: dict[str, Any]) -> dict[str, Any]:
    config = _config(**changed) if rank == 1 else _config()
    _init(config)
    return {}


def _case_load(rank: int, root: Path, engine: Any) -> dict[str, Any]:
    load_dir = root / "ckpt" if rank == 0 else root / "typo"
    before = [p.detach().clone() for p in engine.module.parameters()]
    try:
        engine.load_checkpoint(load_dir)
    finally:
        after = list(engine.module.parameters())
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    return {}


def _case_save(rank: int, root: Path, engine: Any) -> dict[str, Any]:
    engine.save_checkpoint(root / f"local{rank}", tag="t")
    return {}


def _case_nothing_anywhere(rank: int, root: Path, engine: Any) -> dict[str, Any]:
    return {"result": list(engine.load_checkpoint(root / "empty"))}


def _run_case(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        out = fn()
        out["error"] = ""
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}"}
    out["seconds"] = time.perf_counter() - t0
    return out


def _rank_main(rank: int, ws: int, root_text: str) -> dict[str, dict[str, Any]]:
    root = Path(root_text)
    results = {
        f"config {key}": _run_case(lambda k=key, v=value: _case_config(rank, root, {k: v}))
        for key, value in CONFIG_CASES
    }
    results["config fails on one rank"] = _run_case(
        lambda: _case_config(rank, root, {"zero_optimization": {"stage": 3}})
    )
    engine = _init(_config())
    engine.save_checkpoint(root / "ckpt", tag="t")
    results["load: latest on one rank only"] = _run_case(lambda: _case_load(rank, root, engine))
    results["save: a directory per rank"] = _run_case(lambda: _case_save(rank, root, engine))
    results["load: no latest anywhere"] = _run_case(
        lambda: _case_nothing_anywhere(rank, root, engine)
    )
    return results


CONFIG_CASES: list[tuple[str, Any]] = [
    ("gradient_accumulation_steps", 2),
    ("gradient_clipping", 1.0),
    ("zero_optimization", {"stage": 1}),
    ("zero_optimization", {"stage": 2, "reduce_bucket_size": 1000}),
    ("bf16", {"enabled": True}),
    ("communication_data_type", "bf16"),
]


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> tuple[Path, list[dict[str, dict[str, Any]]]]:
    root = tmp_path_factory.mktemp("agreement")
    return root, run_ranks(_rank_main, 2, str(root), timeout_s=60)


def test_config_mismatch_is_the_same_error_on_every_rank(table) -> None:
    _, out = table
    for key, _value in CONFIG_CASES:
        errors = [r[f"config {key}"]["error"] for r in out]
        assert errors[0] == errors[1], errors
        assert errors[0].startswith("ValueError: the DeepSpeed config"), errors[0]
        assert "differs between ranks" in errors[0], errors[0]
        assert all(r[f"config {key}"]["seconds"] < _BOUND_S for r in out)


def test_config_that_fails_on_one_rank_fails_on_every_rank(table) -> None:
    _, out = table
    rank0, rank1 = (r["config fails on one rank"]["error"] for r in out)
    assert "another rank" in rank0, rank0
    assert "zero_optimization.stage" in rank1, rank1


def test_load_with_latest_on_one_rank_only(table) -> None:
    root, out = table
    errors = [r["load: latest on one rank only"]["error"] for r in out]
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("FileNotFoundError: ranks disagree"), errors[0]
    assert str(root / "typo" / "latest") in errors[0]
    assert all(r["load: latest on one rank only"]["seconds"] < _BOUND_S for r in out)


def test_save_to_a_directory_per_rank(table) -> None:
    root, out = table
    errors = [r["save: a directory per rank"]["error"] for r in out]
    assert errors[0] == errors[1], errors
    assert "not one directory shared by every rank" in errors[0], errors[0]
    assert str(root / "local1") in errors[0], errors[0]
    assert _files(root / "local0") == []  # the marker is gone, nothing was saved
    assert not (root / "local1").exists()


def test_nothing_to_load_anywhere_is_the_same_answer(table) -> None:
    _, out = table
    assert all(r["load: no latest anywhere"]["result"] == [None, None] for r in out)
