"""Ranks that disagree (config, checkpoint to load, checkpoint directory) get the same
clear error on every rank, in bounded time, with nothing written or changed (issue 29).

One launch at world size 2 runs the whole table; each case gives rank 1 a different input.
"""

from __future__ import annotations

import os
import subprocess
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


def _case_meta_init(rank: int, root: Path) -> dict[str, Any]:
    """A meta-device model loaded from ``checkpoint=``, a path rank 1 lacks."""
    import flatzero

    with torch.device("meta"):
        model = _model()
    checkpoint = root / ("ckpt" if rank == 0 else "typo")
    flatzero.initialize(model=model, config=_config(), checkpoint=checkpoint)
    return {}


def _case_load_another(rank: int, root: Path, engine: Any) -> dict[str, Any]:
    before = [p.detach().clone() for p in engine.module.parameters()]
    try:
        engine.load_checkpoint(root / ("ckpt" if rank == 0 else "other"))
    finally:
        after = list(engine.module.parameters())
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    return {}


def _case_stage0_load(rank: int, root: Path) -> dict[str, Any]:
    """Stage 0 (every rank loads a one-rank checkpoint alone): rank 1 another one."""
    engine = _init(_config(zero_optimization={"stage": 0}))
    engine.save_checkpoint(root / "s0a", tag="t")
    engine.backward(engine(torch.ones(2, 8)).sum())
    engine.step()
    engine.save_checkpoint(root / "s0b", tag="t")
    _case_load_in(engine, root / ("s0a" if rank == 0 else "s0b"))
    return {}


def _case_load_in(engine: Any, load_dir: Path) -> None:
    before = [p.detach().clone() for p in engine.module.parameters()]
    try:
        engine.load_checkpoint(load_dir)
    finally:
        after = list(engine.module.parameters())
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def _case_save(rank: int, root: Path, engine: Any) -> dict[str, Any]:
    engine.save_checkpoint(root / f"local{rank}", tag="t")
    return {}


def _case_init(rank: int, make_kwargs: Callable[[nn.Module], dict[str, Any]]) -> dict[str, Any]:
    """``initialize`` where rank 1 passes what ``make_kwargs`` gives and rank 0 a good
    engine's arguments."""
    import flatzero

    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    kwargs = make_kwargs(model) if rank == 1 else {"model": model, "config": _config()}
    if rank == 0 and "optimizer" in make_kwargs(model):  # a client optimizer on both ranks
        kwargs = {"model": model, "config": _no_optimizer(), "optimizer": torch.optim.AdamW}
    try:
        flatzero.initialize(**kwargs)
    finally:
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    return {}


def _no_optimizer() -> dict[str, Any]:
    return {k: v for k, v in _config().items() if k != "optimizer"}


def _failing_scheduler(optimizer: Any) -> Any:
    raise ValueError("the script's scheduler function failed")


INIT_CASES: list[tuple[str, Callable[[nn.Module], dict[str, Any]], str, str]] = [
    ("client optimizer not elementwise",
     lambda m: {"model": m, "config": _no_optimizer(), "optimizer": torch.optim.LBFGS},
     "UnsupportedFeatureError", "LBFGS cannot be used"),
    ("empty param group",
     lambda m: {"model": m, "config": _config(), "model_parameters": [{"params": []}]},
     "ValueError", "no trainable parameters"),
    ("lr_scheduler of a wrong type",
     lambda m: {"model": m, "config": _config(), "lr_scheduler": 5},
     "TypeError", "lr_scheduler must be a scheduler"),
    ("scheduler parameter",
     lambda m: {"model": m, "config": _config(scheduler={"type": "StepLR", "params": {}})},
     "ValueError", "does not fit StepLR"),
    ("scheduler function raises",
     lambda m: {"model": m, "config": _config(), "lr_scheduler": _failing_scheduler},
     "ValueError", "the script's scheduler function failed"),
    ("model is None", lambda m: {"model": None, "config": _config()},
     "ValueError", "needs model="),
]  # fmt: skip


def _zero(**kwargs: Any) -> Any:
    import flatzero

    return flatzero.ZeroOptimizer(_model().named_parameters(), **kwargs)


def _load_with_lr(rank: int, lr: float) -> None:
    opt = _zero(optimizer=torch.optim.AdamW, lr=1e-3)
    state = opt.state_dict()
    if rank == 1:
        groups = state["optimizer"]["param_groups"]
        state["optimizer"] = {
            **state["optimizer"],
            "param_groups": [{**g, "lr": lr} for g in groups],
        }
    try:
        opt.load_state_dict(state)
    finally:
        assert opt.param_groups[0]["lr"] == 1e-3  # nothing changed
        opt.close()


def _case_torch(rank: int, make: Callable[[int], Any]) -> dict[str, Any]:
    """The PyTorch door: ``make(rank)`` with rank 1's input different."""
    make(rank)
    return {}


# (name, what each rank runs, (rank 0's error, rank 1's error) beginnings)
TORCH_CASES: list[tuple[str, Callable[[int], Any], tuple[str, str]]] = [
    ("lr < 0 on one rank",
     lambda r: _zero(optimizer=torch.optim.AdamW, lr=-1.0 if r else 1e-3),
     ("ValueError: ZeroOptimizer's arguments", "ValueError: Invalid learning rate: -1.0")),
    ("LBFGS on one rank",
     lambda r: _zero(optimizer=torch.optim.LBFGS if r else torch.optim.AdamW, lr=1e-3),
     ("ValueError: ZeroOptimizer's arguments", "TypeError: LBFGS cannot be used")),
    ("load_state_dict: lr < 0 on one rank", lambda r: _load_with_lr(r, -5.0),
     ("ValueError: load_state_dict failed on another rank",
      "ValueError: param group 0 of the state dict has hyperparameters AdamW refuses")),
    ("load_state_dict: another lr on one rank", lambda r: _load_with_lr(r, 0.5),
     ("ValueError: the loaded hyperparameters", "ValueError: the loaded hyperparameters")),
]  # fmt: skip


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
    torch.optim.AdamW([nn.Parameter(torch.zeros(1))])  # torch's one-time imports, untimed
    results = {
        f"config {key}={value}": _run_case(lambda k=key, v=value: _case_config(rank, root, {k: v}))
        for key, value in CONFIG_CASES
    }
    results["config fails on one rank"] = _run_case(
        lambda: _case_config(rank, root, {"zero_optimization": {"stage": 3}})
    )
    for name, make, _kind, _text in INIT_CASES:
        results[f"init: {name}"] = _run_case(lambda m=make: _case_init(rank, m))
    for name, make, _texts in TORCH_CASES:
        results[f"torch: {name}"] = _run_case(lambda m=make: _case_torch(rank, m))
    engine = _init(_config())
    engine.save_checkpoint(root / "ckpt", tag="t")
    engine.backward(engine(torch.ones(2, 8)).sum())
    engine.step()
    engine.save_checkpoint(root / "other", tag="t")  # another checkpoint, the same tag
    results["load: a directory per rank, each with latest"] = _run_case(
        lambda: _case_load_another(rank, root, engine)
    )
    results["init: checkpoint= missing on one rank"] = _run_case(
        lambda: _case_meta_init(rank, root)
    )
    results["load: optimizer states on one rank only"] = _run_case(
        lambda: engine.load_checkpoint(root / "ckpt", load_optimizer_states=rank == 0)
    )
    results["load: latest on one rank only"] = _run_case(lambda: _case_load(rank, root, engine))
    results["save: a directory per rank"] = _run_case(lambda: _case_save(rank, root, engine))
    for name, kwargs, _error in SAVE_CASES:
        results[f"save: {name}"] = _run_case(
            lambda k=kwargs: engine.save_checkpoint(root / "ckpt", **(k if rank == 1 else {}))
        )
    results["load at stage 0: a directory per rank"] = _run_case(
        lambda: _case_stage0_load(rank, root)
    )
    results["load: no latest anywhere"] = _run_case(
        lambda: _case_nothing_anywhere(rank, root, engine)
    )
    return results


CONFIG_CASES: list[tuple[str, Any]] = [
    ("gradient_accumulation_steps", 2),
    ("gradient_clipping", 0.5),  # DeepSpeed's default is 1.0
    ("zero_optimization", {"stage": 1}),
    ("zero_optimization", {"stage": 2, "reduce_bucket_size": 1000}),
    ("bf16", {"enabled": True}),
    ("communication_data_type", "bf16"),
    ("fp16", {"enabled": True}),
    ("train_batch_size", 4),
    ("zero_optimization", {"stage": 2, "allgather_bucket_size": 1000}),
    ("flatzero", {"progress": False, "bucket_numel": 4096}),
    ("flatzero", {"progress": False, "param_sync": "none"}),
]


# (name, rank 1's save_checkpoint arguments, its error): rank 0 saves as usual
SAVE_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("a bad tag on one rank", {"tag": "../t"}, "ValueError: checkpoint tag '../t' is not usable"),
    ("client_state that JSON cannot hold on one rank", {"tag": "t", "client_state": {"a": {1.5}}},
     "TypeError: client_state['client_state']['a'] is a set"),
]  # fmt: skip


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> tuple[Path, list[dict[str, dict[str, Any]]]]:
    root = tmp_path_factory.mktemp("agreement")
    return root, run_ranks(_rank_main, 2, str(root), timeout_s=60)


def test_config_mismatch_is_the_same_error_on_every_rank(table) -> None:
    _, out = table
    for key, value in CONFIG_CASES:
        errors = [r[f"config {key}={value}"]["error"] for r in out]
        assert errors[0] == errors[1], errors
        assert errors[0].startswith("ValueError: the DeepSpeed config"), errors[0]
        assert "differs between ranks" in errors[0], errors[0]
        assert all(r[f"config {key}={value}"]["seconds"] < _BOUND_S for r in out)


def test_config_that_fails_on_one_rank_fails_on_every_rank(table) -> None:
    _, out = table
    rank0, rank1 = (r["config fails on one rank"]["error"] for r in out)
    assert "failed on rank 1: UnsupportedFeatureError: " in rank0, rank0
    assert "zero_optimization.stage" in rank0 and "zero_optimization.stage" in rank1, rank1


@pytest.mark.parametrize(("name", "kind", "text"), [(c[0], c[2], c[3]) for c in INIT_CASES])
def test_a_user_error_on_one_rank_is_an_error_on_every_rank(table, name, kind, text) -> None:
    """Rank 1's bad optimizer, params, scheduler or arguments reach rank 0 as the same kind
    of error naming it, before the flatten's collectives (no hang, no gloo abort)."""
    _, out = table
    rank0, rank1 = (r[f"init: {name}"]["error"] for r in out)
    assert rank1.startswith(f"{kind}: ") and text in rank1, rank1
    assert rank0.startswith(f"{kind}: ") and "failed on rank 1" in rank0, rank0
    assert text in rank0, rank0
    assert all(r[f"init: {name}"]["seconds"] < _BOUND_S for r in out)


def test_checkpoint_argument_missing_on_one_rank(table) -> None:
    root, out = table
    rank0, rank1 = (r["init: checkpoint= missing on one rank"]["error"] for r in out)
    assert rank1.startswith(f"ValueError: checkpoint={str(root / 'typo')!r} does not exist")
    assert rank0.startswith(
        "ValueError: flatzero.initialize's optimizer, params or scheduler "
        "failed on rank 1: ValueError: checkpoint="
    ), rank0


def test_load_that_restores_other_things_on_one_rank(table) -> None:
    """Rank 1 alone skips the optimizer state: refused on both (its moments and learning
    rate would differ from rank 0's, silently)."""
    _, out = table
    errors = [r["load: optimizer states on one rank only"]["error"] for r in out]
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("ValueError: the load settings"), errors[0]
    assert "load_optimizer_states (rank 0: 'True'; rank 1: 'False')" in errors[0], errors[0]


@pytest.mark.parametrize(("name", "texts"), [(c[0], c[2]) for c in TORCH_CASES])
def test_pytorch_door_error_on_one_rank_is_an_error_on_every_rank(table, name, texts) -> None:
    """``ZeroOptimizer`` and its ``load_state_dict``: rank 1's bad input is an error on both
    ranks before any collective it would not join; nothing changes."""
    _, out = table
    for rank, text in enumerate(texts):
        error = out[rank][f"torch: {name}"]["error"]
        assert error.startswith(text), (rank, error)
        assert out[rank][f"torch: {name}"]["seconds"] < _BOUND_S


def test_load_from_a_directory_per_rank_each_with_latest(table) -> None:
    """Both ranks find a ``latest`` but in different checkpoints: refused on both, nothing
    loaded (their rank files would be mixed)."""
    root, out = table
    errors = [r["load: a directory per rank, each with latest"]["error"] for r in out]
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("ValueError: ranks opened different checkpoints"), errors[0]
    assert str(root / "other" / "t") in errors[0], errors[0]
    assert all(r["load: a directory per rank, each with latest"]["seconds"] < _BOUND_S for r in out)


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


@pytest.mark.parametrize(("name", "text"), [(c[0], c[2]) for c in SAVE_CASES])
def test_a_save_refused_on_one_rank_is_refused_on_every_rank(table, name, text) -> None:
    root, out = table
    rank0, rank1 = (r[f"save: {name}"]["error"] for r in out)
    assert rank1.startswith(text), rank1
    assert rank0.startswith(text.split(":")[0] + ": save_checkpoint failed on rank 1: "), rank0
    assert text.split(": ", 1)[1] in rank0, rank0
    assert sorted(p.name for p in (root / "ckpt").iterdir()) == ["latest", "t", "zero_to_fp32.py"]


def test_stage0_load_from_a_directory_per_rank(table) -> None:
    _, out = table
    errors = [r["load at stage 0: a directory per rank"]["error"] for r in out]
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("ValueError: the checkpoint to load and how"), errors[0]


def test_nothing_to_load_anywhere_is_the_same_answer(table) -> None:
    _, out = table
    assert all(r["load: no latest anywhere"]["result"] == [None, None] for r in out)


def _read_only_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    engine = _init(_config())
    engine.backward(engine(torch.ones(2, 8)).sum())
    engine.step()
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        engine.save_checkpoint(Path(root) / "ro" / "ckpt", tag="t")
    except OSError as error:
        out["error"] = f"{type(error).__name__}: {error}"
    out["seconds"] = time.monotonic() - t0
    engine.backward(engine(torch.ones(2, 8)).sum())  # training goes on
    engine.step()
    engine.save_checkpoint(Path(root) / "rw" / "ckpt", tag="after")
    out["saved after"] = (Path(root) / "rw" / "ckpt" / "after" / "meta.json").is_file()
    engine.destroy()
    return out


def test_a_save_into_a_read_only_directory_is_one_error_on_every_rank(tmp_path):
    """A real read-only mount: every rank gets the same error saying so (rank 0's
    EROFS), promptly and never naming the check's own file; training and saving elsewhere
    go on."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a read-only bind mount")
    ro = tmp_path / "ro"
    (ro / "ckpt").mkdir(parents=True)
    mounted = subprocess.run(["mount", "--bind", str(ro), str(ro)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {mounted.stderr.decode().strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], check=True)
        out = run_ranks(_read_only_rank, 2, str(tmp_path), timeout_s=60)
    finally:
        subprocess.run(["umount", str(ro)], check=False)
    assert out[0]["error"] == out[1]["error"], out
    assert "Read-only file system" in out[0]["error"] and "rank 0" in out[0]["error"]
    assert ".flatzero-shared-check" not in out[0]["error"]
    assert all(r["seconds"] < 4 for r in out), out  # no marker to wait for
    assert all(r["saved after"] for r in out)


def _onto_a_file_rank(rank: int, world_size: int, root: str) -> str:
    engine = _init(_config())
    try:
        engine.save_checkpoint(Path(root) / "a_file")
    except OSError as error:
        return f"{type(error).__name__}: {error}"
    finally:
        engine.destroy()
    return "no error"


@pytest.mark.parametrize("ranks", [1, 2])
def test_saving_onto_a_file_says_it_is_a_file(tmp_path, ranks):
    (tmp_path / "a_file").write_text("not a directory")
    out = run_ranks(_onto_a_file_rank, ranks, str(tmp_path), timeout_s=60)
    assert len(set(out)) == 1, out  # the same error on every rank
    assert "is a file, not a checkpoint directory" in out[0], out
    assert (tmp_path / "a_file").read_text() == "not a directory"
