"""``flatzero.patch_deepspeed()``: what routes where, the error kinds, the patch handle, and
the engine API Hugging Face Accelerate and Trainer use (``tests/test_hf_trainer.py`` runs the
real Trainer and Accelerate).

- Config level (pure): every refusal of ``parse_config`` is either an
  ``UnsupportedFeatureError`` (a DeepSpeed feature flatzero lacks: routed to DeepSpeed) or a
  plain user error (raised as it is); Accelerate's ``steps_per_print: inf`` and
  ``fp16.auto_cast`` are accepted.
- Routing (2 gloo ranks, ``deepspeed.initialize`` replaced by a recorder so that DeepSpeed's
  engine is not built): stage 1/2 with a supported optimizer go to flatzero (with
  ``offload_optimizer: {device: cpu}`` too, which its log line says); stage 0/3, NVMe
  offload, ``mpu``, no optimizer, a non-elementwise optimizer, Lamb go to DeepSpeed with
  one log line on rank 0 naming the reason and the model untouched; user errors raise.
- Engine (2 gloo ranks, DeepSpeed imported): ``isinstance(engine, DeepSpeedEngine)``,
  ``engine.config`` as the raw dict, pass-through to the module, DeepSpeed methods flatzero
  lacks raise naming them; ``set_gradient_accumulation_boundary`` with 3 micro-batches per
  step (config says 2) gives the weights and grad norm of plain AdamW on the same
  gradients; ``get_global_grad_norm()`` without clipping; a LambdaLR over the client
  optimizer drives flatzero's lr, also after ``load_checkpoint``; fp16 overflow sets
  ``optimizer.overflow``; ``fp16.auto_cast`` casts positional inputs; checkpoints tagged
  ``global_step<N>``, overwritten like DeepSpeed's.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flatzero import UnsupportedFeatureError
from flatzero.deepspeed.engine.config import parse_config
from flatzero.launch import run_ranks
from test_ds_config import ERRORS

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"
)

UNSUPPORTED = {  # ids of test_ds_config.ERRORS that ask for a DeepSpeed feature
    "stage3",
    "offload_opt",
    "offload_param",
    "cpu_offload",
    "hpz",
    "qw",
    "qg",
    "mics",
    "fp16_master",
    "bf16_master",
    "lamb",
    "bias_corr",
    "onecycle",
    "amp",
    "autocast",
    "compile",
    "sp",
    "tp",
    "sum",
    "managed",
}


# ------------------------------------------------------------------------- config level
@pytest.mark.parametrize(
    ("config", "world_size", "message", "unsupported"),
    [
        pytest.param(p.values[0], p.values[1], p.values[3], p.id in UNSUPPORTED, id=p.id)
        for p in ERRORS
    ],
)
def test_every_refusal_is_either_unsupported_or_a_user_error(
    config, world_size, message, unsupported
):
    with pytest.raises((ValueError, TypeError)) as info:
        parse_config(config, world_size=world_size)
    assert str(info.value) == message
    assert isinstance(info.value, UnsupportedFeatureError) is unsupported
    if unsupported:
        assert info.value.key in message and info.value.feature


def test_accelerate_config_keys_are_accepted():
    # What Accelerate writes into every DeepSpeed config it prepares.
    cfg = parse_config(
        {
            "train_micro_batch_size_per_gpu": 2,
            "steps_per_print": float("inf"),
            "zero_allow_untested_optimizer": True,
            "fp16": {"enabled": True, "auto_cast": True},
            "zero_optimization": {"stage": 2, "stage3_gather_16bit_weights_on_model_save": False},
        },
        world_size=2,
    )
    assert cfg.steps_per_print is None
    assert cfg.precision.dtype == "fp16" and cfg.precision.auto_cast
    off = parse_config(
        {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": False, "auto_cast": True}},
        world_size=1,
    )
    assert not off.precision.auto_cast and ("fp16.auto_cast", "fp16 is off") in off.ignored


def test_compat_class_only_when_deepspeed_is_imported(monkeypatch):
    from flatzero.deepspeed.engine.deepspeed_compat import deepspeed_engine_class

    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    assert deepspeed_engine_class() is None


# ----------------------------------------------------------------------------- routing
def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def zero2(**extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 64},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.05, "weight_decay": 0.0}},
        "steps_per_print": float("inf"),
        "flatzero": {"progress": False},
        **extra,
    }


class Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname}: {record.getMessage()}")


class NotElementwise(torch.optim.Optimizer):
    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})


def _skip_shm_op() -> None:
    """As ``flatzero.testing.deepspeed`` does: DeepSpeed's CPU communication backend
    (which the router initializes, as ``deepspeed.initialize`` would) otherwise JIT-compiles
    its ``deepspeed_shm_comm`` op (about 40 s with g++; inference all-reduce only)."""
    import deepspeed.ops

    for name in list(deepspeed.ops.__compatible_ops__):
        if "shm_comm" in name:
            deepspeed.ops.__compatible_ops__[name] = False


def _routing(rank: int, ws: int, tmp: str) -> dict[str, Any]:
    import deepspeed

    import flatzero

    _skip_shm_op()
    from flatzero.deepspeed.engine import Engine

    calls: list[dict[str, Any]] = []

    def recorder(**kwargs: Any) -> tuple:
        calls.append(kwargs)
        return ("deepspeed", None, None, None)

    log = Recorder()
    logging.getLogger("flatzero.deepspeed.patch").addHandler(log)
    logging.getLogger("flatzero.deepspeed.patch").setLevel(logging.INFO)
    real = deepspeed.initialize
    deepspeed.initialize = recorder
    out: dict[str, Any] = {"routes": {}, "errors": {}}
    try:
        with flatzero.patch_deepspeed() as patch:
            assert patch.active and deepspeed.initialize is patch.router
            again = flatzero.patch_deepspeed()  # already active: a handle that undoes nothing
            assert again.original is None and not again.active
            again.undo()
            assert deepspeed.initialize is patch.router

            model = make_model()
            engine, opt, _, _ = deepspeed.initialize(model=model, config=zero2())
            assert isinstance(engine, Engine) and isinstance(engine, deepspeed.DeepSpeedEngine)
            assert opt is engine.optimizer and not calls
            engine.destroy()
            out["routes"]["zero2"] = "flatzero"
            offload = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
            engine, opt, _, _ = deepspeed.initialize(
                model=make_model(), config=zero2(zero_optimization=offload)
            )
            assert not calls and engine.zero_cpu_offload()
            assert opt.master_shards[0].device.type == "cpu"
            engine.destroy()
            out["routes"]["cpu_offload"] = "flatzero"

            args = type("Args", (), {})()
            args.deepspeed_config = str(Path(tmp) / "stage0.json")
            if rank == 0:
                Path(args.deepspeed_config).write_text('{"train_micro_batch_size_per_gpu": 1}')
            dist.barrier()
            no_opt = {k: v for k, v in zero2().items() if k != "optimizer"}
            cases = {
                "no_zero_section": {"config": {"train_micro_batch_size_per_gpu": 1}},
                "stage0": {"config": zero2(zero_optimization={"stage": 0})},
                "stage0_from_args": {"args": args},
                "stage3": {"config": zero2(zero_optimization={"stage": 3})},
                "nvme_offload": {
                    "config": zero2(
                        zero_optimization={"stage": 2, "offload_optimizer": {"device": "nvme"}}
                    )
                },
                "mpu": {"config": zero2(), "mpu": object()},
                "no_optimizer": {"config": no_opt},
                "lamb": {"config": zero2(optimizer={"type": "Lamb", "params": {"lr": 0.1}})},
                "not_elementwise": {"config": no_opt, "optimizer": "NotElementwise"},
            }
            for name, kwargs in cases.items():
                model = make_model()
                before = [p.data_ptr() for p in model.parameters()]
                if kwargs.get("optimizer") == "NotElementwise":
                    kwargs = {**kwargs, "optimizer": NotElementwise(model.parameters())}
                n = len(calls)
                result = deepspeed.initialize(model=model, **kwargs)
                assert result[0] == "deepspeed" and len(calls) == n + 1, name
                assert calls[-1]["model"] is model, name
                assert [p.data_ptr() for p in model.parameters()] == before, name
                out["routes"][name] = "deepspeed"

            user_errors = {
                "misspelled": zero2(zero_optimization={"stage": 2, "reduce_bucket_sise": 64}),
                "batch": zero2(train_batch_size=3),
                "auto": zero2(gradient_clipping="auto"),
            }
            for name, config in user_errors.items():
                n = len(calls)
                try:
                    deepspeed.initialize(model=make_model(), config=config)
                except (ValueError, TypeError) as error:
                    out["errors"][name] = (type(error).__name__, str(error))
                assert len(calls) == n, name
        assert deepspeed.initialize is recorder and not patch.active
        patch.undo()  # idempotent
        assert deepspeed.initialize is recorder
    finally:
        deepspeed.initialize = real
        logging.getLogger("flatzero.deepspeed.patch").removeHandler(log)
    out["log"] = log.lines
    return out


def _both(rank: int, ws: int, tmp: str) -> dict[str, Any]:
    (Path(tmp) / "routing").mkdir(exist_ok=True)
    (Path(tmp) / "engine").mkdir(exist_ok=True)
    return {
        "routing": _routing(rank, ws, str(Path(tmp) / "routing")),
        "engine": _engine_api(rank, ws, str(Path(tmp) / "engine")),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both checks in one 2-rank world (each rank imports DeepSpeed once)."""
    tmp = tmp_path_factory.mktemp("patch")
    return run_ranks(_both, 2, str(tmp), env={"DS_ACCELERATOR": "cpu"})


@pytest.mark.slow
@needs_deepspeed
def test_routing(ranks):
    results = [r["routing"] for r in ranks]
    for out in results:
        assert set(out["routes"]) == {
            "zero2",
            "cpu_offload",
            "no_zero_section",
            "stage0",
            "stage0_from_args",
            "stage3",
            "nvme_offload",
            "mpu",
            "no_optimizer",
            "lamb",
            "not_elementwise",
        }
        assert out["errors"] == {
            "misspelled": (
                "ValueError",
                "config key 'zero_optimization.reduce_bucket_sise' is not a key of "
                "'zero_optimization' that DeepSpeed or flatzero knows (known: stage, "
                "reduce_bucket_size, allgather_bucket_size, overlap_comm, contiguous_gradients, "
                "offload_optimizer, offload_param, stage3_*, ...); fix its spelling or remove it",
            ),
            "batch": (
                "ValueError",
                "train_batch_size (3) must equal train_micro_batch_size_per_gpu (1) * "
                "gradient_accumulation_steps (2) * world size (2) = 4; fix one of them, or give "
                "only two and let the third be derived",
            ),
            "auto": (
                "ValueError",
                "config key 'gradient_clipping' is 'auto': 'auto' is a placeholder that the "
                "Hugging Face Trainer fills in before it calls deepspeed.initialize; "
                "flatzero.initialize needs the value itself: write the number (or remove the "
                "key to take DeepSpeed's default)",
            ),
        }
    assert results[1]["log"] == []  # rank 0 says it
    log = results[0]["log"]
    assert len(log) == 11  # one line per call
    assert log[0].startswith("INFO: deepspeed.initialize -> flatzero: ZeRO stage 2, fp32, AdamW")
    assert log[1].startswith("INFO: deepspeed.initialize -> flatzero: ZeRO stage 2, fp32, AdamW")
    assert "optimizer offloaded to the host" in log[1] and "offloaded" not in log[0]
    expected = [
        "ZeRO stage 0 (no 'zero_optimization.stage' 1 or 2): flatzero takes stages 1 and 2",
        "ZeRO stage 0",
        "ZeRO stage 0",
        "config key 'zero_optimization.stage' is 3: flatzero implements ZeRO stages 0, 1 and 2",
        "config key 'zero_optimization.offload_optimizer.device' is 'nvme': flatzero offloads "
        "the optimizer to host memory ('cpu'), not to NVMe",
        "mpu/mesh_param ask for model parallelism",
        "flatzero.initialize needs an optimizer",
        "config key 'optimizer.type' is 'Lamb'",
        "optimizer: ZeroOptimizer does not know whether",
    ]
    for line, reason in zip(log[2:], expected, strict=True):
        assert line.startswith("WARNING: deepspeed.initialize -> DeepSpeed 0.19.8: "), line
        assert reason in line, (reason, line)


# ------------------------------------------------------------------------------ engine
def _reference(steps: int, data: torch.Tensor, targets: torch.Tensor, ws: int, gas: int):
    """Plain AdamW over the gradient DeepSpeed's rule gives: the mean over ranks of the sum
    over micro-batches of grad(loss / gas). Returns the weights and the norm of each step."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.0)
    norms = []
    for step in range(steps):
        for rank in range(ws):
            for micro in range(data.shape[2]):
                loss = nn.functional.mse_loss(
                    model(data[step, rank, micro]), targets[step, rank, micro]
                )
                (loss / gas / ws).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)))
        opt.step()
        opt.zero_grad()
    return dict(model.named_parameters()), norms


def _engine_api(rank: int, ws: int, tmp: str) -> dict[str, Any]:
    import deepspeed

    import flatzero

    _skip_shm_op()

    out: dict[str, Any] = {}
    # The boundary Accelerate decides: 3 micro-batches per step where the config says 2.
    g = torch.Generator().manual_seed(5)
    data = torch.randn(2, ws, 3, 2, 4, generator=g)
    targets = torch.randn(2, ws, 3, 2, 1, generator=g)
    model = make_model()
    model.custom_attr = "from the module"
    config = {**zero2(), "gradient_clipping": 0.0}  # the reference does not clip
    engine, opt, _, _ = flatzero.initialize(model=model, config=config)
    assert isinstance(engine, deepspeed.DeepSpeedEngine)
    assert type(engine).__mro__[1] is flatzero.deepspeed.engine.Engine  # flatzero's methods first
    assert engine.config == config and isinstance(engine.config, dict)
    assert engine.config.get("zero_optimization", {}).get("stage") == 2  # what Trainer reads
    assert engine.parsed_config.zero.stage == 2 and engine.steps_per_print() is None
    assert engine.custom_attr == "from the module"  # pass-through, as DeepSpeed's engine
    assert engine.zero_optimization_partition_gradients() and not engine.zero_offload_optimizer()
    with pytest.raises(NotImplementedError, match=r"DeepSpeedEngine\.offload_states is not"):
        engine.offload_states()
    with pytest.raises(NotImplementedError, match=r"DeepSpeedEngine\.no_sync"):
        engine.no_sync()
    with pytest.raises(AttributeError, match="no attribute 'nothing_like_this'"):
        engine.nothing_like_this  # noqa: B018
    assert engine.get_global_grad_norm() is None and opt.overflow is False
    norms = []
    for step in range(2):
        for micro in range(3):
            engine.set_gradient_accumulation_boundary(micro == 2)
            assert engine.is_gradient_accumulation_boundary() is (micro == 2)
            loss = nn.functional.mse_loss(
                engine(data[step, rank, micro]), targets[step, rank, micro]
            )
            engine.backward(loss)
            if micro == 2:
                engine.step()
                norms.append(engine.get_global_grad_norm())
    assert engine.global_steps == 2 and engine.micro_steps == 2 and opt.overflow is False
    ref, ref_norms = _reference(2, data, targets, ws, gas=2)
    full = opt.full_params()
    out["weight_error"] = max(float((full[n] - ref[n].detach()).abs().max()) for n in full)
    out["norms"] = (norms, ref_norms)

    # Checkpoints as DeepSpeed tags them; the same tag again replaces it.
    assert engine.save_checkpoint(tmp) is True
    assert engine.save_checkpoint(tmp) is True
    path, client_state = engine.load_checkpoint(tmp)
    assert Path(path).name == "global_step2" and client_state == {}
    assert engine.load_checkpoint(Path(tmp) / "nothing") == (None, None)
    ds_dir = Path(tmp) / "from_deepspeed"
    if rank == 0:
        (ds_dir / "global_step1").mkdir(parents=True)
        (ds_dir / "global_step1" / "mp_rank_00_model_states.pt").write_bytes(b"")
        (ds_dir / "latest").write_text("global_step1")
    dist.barrier()
    with pytest.raises(ValueError, match="global_step1 is a DeepSpeed checkpoint; flatzero's"):
        engine.load_checkpoint(ds_dir)
    engine.destroy()
    engine.destroy()  # twice is fine

    # A LambdaLR built over the client optimizer before initialize drives flatzero's lr.
    model = make_model()
    client = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(client, lambda s: 0.5**s)
    no_opt = {k: v for k, v in zero2().items() if k != "optimizer"}
    engine, opt, _, _ = flatzero.initialize(model=model, optimizer=client, config=no_opt)
    assert engine.client_optimizer is client
    assert client.param_groups[0]["params"] == list(model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            for micro in range(2):
                loss = nn.functional.mse_loss(
                    engine(data[step, rank, micro]), targets[step, rank, micro]
                )
                engine.backward(loss)
                engine.step()
            sched.step()
    # torch warns when its scheduler steps before its optimizer did (flatzero marks the step)
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert opt.param_groups[0]["lr"] == client.param_groups[0]["lr"] == 0.1 * 0.5**2
    opt.param_groups[0]["lr"] = 0.3
    assert client.param_groups[0]["lr"] == 0.3
    engine.save_checkpoint(Path(tmp) / "linked")
    engine.load_checkpoint(Path(tmp) / "linked")  # replaces flatzero's param groups
    client.param_groups[0]["lr"] = 0.7
    assert opt.param_groups[0]["lr"] == 0.7
    engine.destroy()

    # fp16: an overflow skips the step and says so; auto_cast casts positional inputs.
    seen: list[torch.dtype] = []
    model = make_model()
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    fp16 = zero2(fp16={"enabled": True, "auto_cast": True, "initial_scale_power": 8})
    engine, opt, _, _ = flatzero.initialize(model=model, config=fp16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.set_gradient_accumulation_boundary(True)
    out_ = engine(data[0, rank, 0])
    engine.backward(out_.float().sum() * float("inf"))
    engine.step()
    assert opt.overflow is True and not engine.was_step_applied() and engine.skipped_steps == 1
    assert not math.isfinite(engine.get_global_grad_norm())
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    engine.backward(nn.functional.mse_loss(engine(data[0, rank, 1]).float(), targets[0, rank, 1]))
    engine.step()
    assert opt.overflow is False and engine.was_step_applied()
    assert math.isfinite(engine.get_global_grad_norm())
    assert seen == [torch.float16, torch.float16]
    assert engine.fp16_enabled() and engine.fp16_auto_cast() and not engine.bfloat16_enabled()
    engine.destroy()
    return out


@pytest.mark.slow
@needs_deepspeed
def test_engine_as_accelerate_and_trainer_use_it(ranks):
    for out in (r["engine"] for r in ranks):
        assert out["weight_error"] < 1e-6, out["weight_error"]
        norms, ref = out["norms"]
        assert norms == pytest.approx(ref, rel=1e-5)


def test_client_link_without_flatten():
    """``LinkedParamGroup`` mapping behaviour (setdefault, iteration, deletion) on a stand-in
    optimizer; the linked values are flatzero's groups'."""
    from flatzero.deepspeed.engine.client import LinkedParamGroup, link_client_optimizer

    p = nn.Parameter(torch.zeros(2))
    client = torch.optim.SGD([p], lr=0.1)

    class Layout:
        group_index = 0

    class Flat:
        layout = Layout()

    class Stub:
        def __init__(self) -> None:
            self.param_groups = [{"params": [torch.zeros(1)], "lr": 0.1, "momentum": 0.0}]
            self.flat = type("F", (), {"groups": [Flat()]})()

    stub = Stub()
    link_client_optimizer(client, stub)
    link_client_optimizer(client, stub)  # idempotent
    group = client.param_groups[0]
    assert isinstance(group, LinkedParamGroup) and group["params"] == [p]
    assert group.setdefault("initial_lr", 0.1) == 0.1 and stub.param_groups[0]["initial_lr"] == 0.1
    group["lr"] = 0.2
    assert stub.param_groups[0]["lr"] == 0.2
    stub.param_groups = [dict(stub.param_groups[0], lr=0.4)]  # load_state_dict's new dicts
    assert group["lr"] == 0.4
    assert set(group) >= {"params", "lr", "momentum", "initial_lr"}
    del group["initial_lr"]
    assert "initial_lr" not in group and "initial_lr" not in stub.param_groups[0]
    copy.copy(client.state_dict())  # torch packs the groups as mappings


# ---------------------------------------------------------------------------- launcher
PROBE = """
import json, sys
import deepspeed
json.dump(
    {
        "name": __name__,
        "argv": sys.argv,
        "path0": sys.path[0],
        "patched": getattr(deepspeed.initialize, "__flatzero_router__", False),
    },
    open(sys.argv[-1], "w"),
)
"""


def _flatzero_run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parents[1] / "src"), env.get("PYTHONPATH")) if p
    )
    return subprocess.run(
        [sys.executable, "-m", "flatzero.run", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_launcher_usage_errors(capsys):
    from flatzero.run import main

    for argv, code in (([], 2), (["-m"], 2), (["nothing_here.py"], 2), (["--help"], 0)):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == code, argv
    out = capsys.readouterr()
    assert "no such script: 'nothing_here.py'" in out.err
    assert "torchrun --nproc-per-node 8 -m flatzero.run" in out.out


def test_launcher_runs_a_module_as_main(tmp_path, monkeypatch):
    """``-m MODULE``: run as ``python -m`` would (the patch itself is stubbed here; the script
    test below runs the real one)."""
    import flatzero.deepspeed.patch
    import flatzero.run

    applied = []
    monkeypatch.setattr(flatzero.deepspeed.patch, "patch_deepspeed", lambda: applied.append(True))
    monkeypatch.setattr(flatzero.run, "_show_flatzero_logs", lambda: None)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.syspath_prepend(str(tmp_path))
    stub = 'deepspeed = type("Stub", (), {"initialize": None})'
    (tmp_path / "probe_mod.py").write_text(PROBE.replace("import deepspeed", stub))
    out = tmp_path / "m.json"
    flatzero.run.main(["-m", "probe_mod", "--x", str(out)])
    seen = json.loads(out.read_text())
    assert applied == [True] and seen["name"] == "__main__"
    assert seen["argv"] == [str(tmp_path / "probe_mod.py"), "--x", str(out)]


@pytest.mark.slow
@needs_deepspeed
def test_launcher_runs_a_script_as_main(tmp_path):
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "probe.py").write_text(PROBE)
    result = _flatzero_run(["scripts/probe.py", "--flag", "x", str(tmp_path / "s.json")], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads((tmp_path / "s.json").read_text())
    assert seen == {
        "name": "__main__",
        "argv": ["scripts/probe.py", "--flag", "x", str(tmp_path / "s.json")],
        "path0": str(scripts),
        "patched": True,
    }
