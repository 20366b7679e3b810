"""Leaving flatzero: ``to_deepspeed`` writes a checkpoint real DeepSpeed 0.19.8 resumes.

One 2-rank spawn (gloo, DeepSpeed's CPU accelerator, a client ``torch.optim.AdamW`` over
two param groups of a model with a tied weight, a frozen param and a buffer) runs, per
case: ``flatzero.initialize`` trains ``K + M`` steps and saves after ``K`` (the
uninterrupted reference), rank 0 exports the checkpoint, ``deepspeed.initialize`` +
``engine.load_checkpoint`` on the export trains the last ``M`` steps, and DeepSpeed saves
its own checkpoint afterwards. Cases: ZeRO-2 bf16 with a WarmupLR schedule and DeepSpeed's
round-robin, parameter-aligned flat layout; ZeRO-1 fp16 with a dynamic loss scale that
grows during the run; two whose config has an ``optimizer`` section of type AdamW without
``torch_adam`` (the Hugging Face docs' configs), for which DeepSpeed builds its own kernels:
ZeRO-2 bf16 (FusedAdam) and ZeRO-1 fp32 with optimizer offload (DeepSpeedCPUAdam); ZeRO-1
fp32 saved by one rank (``ZeroOptimizer`` in this process) and exported for two. A 1-rank
spawn resumes that checkpoint exported without a config (DeepSpeed's default, FusedAdam)
in a one-rank DeepSpeed run (DeepSpeed's Adam ops are built for its CPU accelerator before
the spawns; where they cannot be, those cases are skipped). The same spawns run DeepSpeed's
``zero_to_fp32`` on the exports and on DeepSpeed's own checkpoints. Everything else
(round trips, DeepSpeed's checkpoints imported by the safe reader, a crafted pickle, the
errors, Trainer directories, the CLI) runs in this process without DeepSpeed.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from flatzero import FlattenConfig
from flatzero.checkpoint import (
    CheckpointReader,
    ExportConfig,
    atomic,
    export_checkpoint,
    read_latest,
    save_checkpoint,
)
from flatzero.cli import main
from flatzero.deepspeed import pickle as ds_pickle
from flatzero.deepspeed.convert import from_deepspeed, to_deepspeed
from flatzero.deepspeed.pickle import ZeroStage
from flatzero.deepspeed.reader import read_deepspeed
from flatzero.launch import run_ranks
from flatzero.optim import ZeroConfig, ZeroOptimizer
from flatzero.storage.tensorfile import open_safetensors
from flatzero.testing.deepspeed import deepspeed_available

K, M = 3, 2  # steps before the save, steps after it
BATCH, SEQ, VOCAB, LR = 4, 10, 48, 3e-3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CASES = {
    "zero2_bf16": (2, "bf16"),
    "zero1_fp16": (1, "fp16"),
    "zero2_bf16_fused_adam": (2, "bf16"),
    "zero1_fp32_cpu_adam": (1, "fp32"),
}
# the config's optimizer section, AdamW without torch_adam: DeepSpeed builds its own kernel
KERNELS = {"zero2_bf16_fused_adam": "FusedAdam", "zero1_fp32_cpu_adam": "DeepSpeedCPUAdam"}
WS1 = "zero1_fp32_ws1"  # saved by one rank here, exported for two
ONE = "zero1_fp32_ws1_fused_adam"  # the same checkpoint exported without a config for one


class Net(nn.Module):
    """Odd widths, an embedding tied to the head, a frozen param and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 24)
        self.fc1 = nn.Linear(24, 37)
        self.fc2 = nn.Linear(37, 24)
        self.norm = nn.LayerNorm(24)
        self.head = nn.Linear(24, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, 24), requires_grad=False)
        self.register_buffer("temperature", torch.tensor(0.9))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.fc2(torch.relu(self.fc1(h))) * self.gate
        logits = self.head(self.norm(h)).float() / self.temperature.float()
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)
        )


def build(dtype: str, seed: int) -> tuple[Net, torch.optim.Optimizer]:
    """The model and its client AdamW over two groups (matrices decay, the rest not)."""
    torch.manual_seed(seed)
    model = Net().to(DTYPES[dtype])
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for _, p in named if p.ndim > 1], "weight_decay": 0.1},
        {"params": [p for _, p in named if p.ndim <= 1], "weight_decay": 0.0},
    ]
    return model, torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95))


def batch(step: int, rank: int, ws: int) -> torch.Tensor:
    data = torch.randint(0, VOCAB, (K + M, BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    per = BATCH // ws
    return data[step, rank * per : (rank + 1) * per]


def config(stage: int, dtype: str, scheduler: bool) -> dict:
    cfg = {
        "train_batch_size": BATCH,
        "train_micro_batch_size_per_gpu": BATCH // 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 2**31 - 1,
        "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 800},
        "bf16": {"enabled": dtype == "bf16"},
        # a window of 2 grows the scale at steps 2 and 4: the state must carry over exactly
        "fp16": {
            "enabled": dtype == "fp16",
            "initial_scale_power": 8,
            "loss_scale_window": 2,
            "hysteresis": 1,
        },
    }
    if scheduler:
        cfg["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 10},
        }
    return cfg


def case_config(case: str) -> dict:
    if case == WS1:
        return config(1, "fp32", scheduler=False)
    if case == ONE:  # DeepSpeed's AdamW on one rank
        cfg = config(1, "fp32", scheduler=False) | {"train_micro_batch_size_per_gpu": BATCH}
        return cfg | {"optimizer": {"type": "AdamW", "params": {"lr": LR}}}
    stage, dtype = CASES[case]
    cfg = config(stage, dtype, scheduler=dtype == "bf16")
    if case == "zero2_bf16":  # DeepSpeed's other flat layouts (no effect in flatzero)
        cfg["zero_optimization"] |= {"round_robin_gradients": True, "parameter_alignment": True}
    if case in KERNELS:  # DeepSpeed's default optimizer: FusedAdam, DeepSpeedCPUAdam offloaded
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95]}}
    if KERNELS.get(case) == "DeepSpeedCPUAdam":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def start(init, model, client, case: str):
    """``init`` (``flatzero.initialize`` or ``deepspeed.initialize``) with the client
    optimizer, or with the config's over the client's two param groups."""
    cfg = case_config(case)
    if "optimizer" not in cfg:
        return init(model=model, optimizer=client, config=cfg)[0]
    groups = [
        {"params": g["params"], "weight_decay": g["weight_decay"]} for g in client.param_groups
    ]
    return init(model=model, model_parameters=groups, config=cfg)[0]


def global_mean(loss: torch.Tensor, ws: int) -> float:
    value = loss.detach().float().clone()
    if ws > 1:
        dist.all_reduce(value)
        value /= ws
    return float(value)


def step(engine, at: int, rank: int, ws: int) -> tuple[float, float, float]:
    """One step; the global loss, then the lr and loss scale the step left."""
    loss = engine(batch(at, rank, ws))
    value = global_mean(loss, ws)
    engine.backward(loss)
    engine.step()
    return value, engine.get_lr()[0], float(engine.optimizer.loss_scale)


# ------------------------------------------------------------------- the 2-rank spawn
def flatzero_run(rank: int, ws: int, root: Path, case: str) -> list:
    """K + M steps under flatzero, saved after K."""
    import flatzero

    model, client = build(CASES[case][1], seed=0)
    engine = start(flatzero.initialize, model, client, case)
    steps = []
    for at in range(K + M):
        if at == K:
            engine.save_checkpoint(root / "fz", client_state={"epoch": 7})
        steps.append(step(engine, at, rank, ws))
    engine.destroy()
    return steps


def deepspeed_resume(rank: int, ws: int, root: Path, case: str) -> dict:
    """Load the export into a fresh DeepSpeed engine, train M steps, save DeepSpeed's own."""
    import deepspeed

    from flatzero.testing.deepspeed import release_engine

    dtype = "fp32" if case in (WS1, ONE) else CASES[case][1]
    model, client = build(dtype, seed=123)  # another init: all must come from the export
    with contextlib.redirect_stdout(io.StringIO()):
        engine = start(deepspeed.initialize, model, client, case)
        path, client_state = engine.load_checkpoint(str(root / "ds"))
    loaded = {
        "lr": engine.get_lr()[0],
        "scale": float(engine.optimizer.loss_scale),
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "epoch": client_state.get("epoch"),
        "temperature": float(model.temperature),
        "gate": model.gate.detach().float().clone(),
        "optimizer": own_format(engine.basic_optimizer),
    }
    steps = [step(engine, at, rank, ws) for at in range(K, K + M)]
    with contextlib.redirect_stdout(io.StringIO()):
        engine.save_checkpoint(str(root / "ds_after"), client_state={"epoch": 8})
    release_engine(engine)
    return {"loaded": loaded, "steps": steps, "path": path}


def own_format(optimizer: torch.optim.Optimizer) -> dict:
    """The class DeepSpeed built, and the param-group keys and state types of a fresh one
    of the same class after one step (what it reads and keeps)."""
    cls = type(optimizer)
    if cls.__module__.startswith("torch.optim"):
        return {"class": cls.__name__}
    param = nn.Parameter(torch.ones(8))
    fresh = cls([param])
    param.grad = torch.ones(8)
    fresh.step()
    saved = fresh.state_dict()
    return {
        "class": cls.__name__,
        "group": set(saved["param_groups"][0]) - {"params"},
        "state": {k: structure(v) for k, v in saved["state"][0].items()},
    }


def consolidated(directory: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(directory)))


def rank_main(rank: int, ws: int, root: str, cases: list[str]) -> bytes:
    from deepspeed.accelerator import get_accelerator

    from flatzero.testing.deepspeed import prepare_deepspeed

    prepare_deepspeed(warmup=False)
    # DeepSpeed's CPU accelerator claims fp16 only with AVX512-FP16; torch runs it anyway
    get_accelerator().is_fp16_supported = lambda: True
    out: dict = {}
    for case in cases:
        where = Path(root) / case
        result = {}
        if case in CASES:
            result["flatzero"] = flatzero_run(rank, ws, where, case)
            dist.barrier()
            if rank == 0:
                to_deepspeed(where / "fz", where / "ds", world_size=ws, ds_config=case_config(case))
            dist.barrier()
        result["deepspeed"] = deepspeed_resume(rank, ws, where, case)
        if rank == 0:
            result["zero_to_fp32"] = consolidated(where / "ds")
            result["zero_to_fp32_after"] = consolidated(where / "ds_after")
            dist.barrier()
        else:
            dist.barrier()
        out[case] = result
    buffer = io.BytesIO()
    torch.save(out if rank == 0 else None, buffer)
    return buffer.getvalue()


def flatzero_ws1(root: Path) -> list:
    """The ws=1 case's reference in this process: ZeroOptimizer, saved after K steps,
    exported for 2 ranks."""
    model, _ = build("fp32", seed=0)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [(n, p) for n, p in named if p.ndim > 1], "weight_decay": 0.1},
        {"params": [(n, p) for n, p in named if p.ndim <= 1], "weight_decay": 0.0},
    ]
    opt = ZeroOptimizer(
        groups,
        torch.optim.AdamW,
        config=ZeroConfig(stage=1, max_grad_norm=1.0),
        flatten_config=FlattenConfig(bucket_numel=400, progress=False),
        lr=LR,
        betas=(0.9, 0.95),
    )
    losses = []
    for at in range(K + M):
        if at == K:
            save_checkpoint(root / "fz", opt, model=model, extra={"epoch": 7})
        loss = model(batch(at, 0, 1))
        losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    to_deepspeed(root / "fz", root / "ds", world_size=2, ds_config=case_config(WS1))
    # without a config: DeepSpeed's default for AdamW, FusedAdam, for one rank
    to_deepspeed(root / "fz", root.parent / ONE / "ds", world_size=1)
    return losses


def adam_kernels() -> str | None:
    """Build (the first time on a machine: JIT-compiled with g++, minutes; then cached in
    ``~/.cache/torch_extensions``) or load DeepSpeed's FusedAdam and CPU Adam ops for its
    CPU accelerator, outside the spawns' timeouts; why not, when they cannot be."""
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder

        with contextlib.redirect_stdout(io.StringIO()):
            FusedAdamBuilder().load()
            CPUAdamBuilder().load()
    except Exception as error:  # no compiler, a failed build: anything the build raises
        return f"{type(error).__name__}: {error}"
    return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict]:
    ok, why = deepspeed_available()
    if not ok:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("export")
    ws1 = flatzero_ws1(root / WS1)
    cases, one = [*CASES, WS1], [ONE]
    no_kernels = adam_kernels()
    if no_kernels is not None:  # the cases DeepSpeed runs with its own Adam are skipped
        cases, one = [c for c in cases if c not in KERNELS], []
    env = {"DS_ACCELERATOR": "cpu"}
    blob = run_ranks(rank_main, 2, str(root), cases, timeout_s=300, env=env)[0]
    out = torch.load(io.BytesIO(blob), weights_only=False)
    if one:
        blob = run_ranks(rank_main, 1, str(root), one, timeout_s=300, env=env)[0]
        out |= torch.load(io.BytesIO(blob), weights_only=False)
    for case in (*KERNELS, ONE):
        out.setdefault(case, {"skip": f"DeepSpeed's Adam ops cannot be built: {no_kernels}"})
    out[WS1]["flatzero"] = ws1
    out[ONE]["flatzero"] = ws1
    return root, out


def ran(out: dict, case: str) -> dict:
    """The case's results; skips the test when the case could not run here."""
    if "skip" in out[case]:
        pytest.skip(out[case]["skip"])
    return out[case]


# ----------------------------------------------------------------- DeepSpeed resumes
# After the load, flatzero and DeepSpeed run the same forward on the same weights and the
# same update on the same masters and moments; the only freedom is the order of the
# gradient reductions, in fp32.
TOLERANCE = 1e-5


@pytest.mark.parametrize("case", list(CASES))
def test_deepspeed_resumes_the_export(runs, case):
    _, out = runs
    ours, theirs = ran(out, case)["flatzero"], ran(out, case)["deepspeed"]
    worst = max(abs(t[0] / o[0] - 1) for t, o in zip(theirs["steps"], ours[K:], strict=True))
    print(f"{case}: largest relative loss difference after the load {worst:.1e}")
    assert [s[0] for s in theirs["steps"]] == pytest.approx([s[0] for s in ours[K:]], rel=TOLERANCE)
    assert [s[1] for s in theirs["steps"]] == pytest.approx([s[1] for s in ours[K:]], rel=1e-12)
    assert [s[2] for s in theirs["steps"]] == [s[2] for s in ours[K:]]  # loss scale, exactly
    loaded = theirs["loaded"]
    assert theirs["path"].endswith(f"ds/global_step{K}/mp_rank_00_model_states.pt")
    assert loaded["lr"] == ours[K - 1][1] and loaded["scale"] == ours[K - 1][2]
    assert loaded["global_steps"] == K and loaded["global_samples"] == K * BATCH
    assert loaded["epoch"] == 7
    assert loaded["temperature"] == pytest.approx(0.9, rel=1e-2)
    assert torch.equal(
        loaded["gate"], torch.linspace(0.5, 1.5, 24).to(DTYPES[CASES[case][1]]).float()
    )


def test_fp16_loss_scale_grew_across_the_resume(runs):
    _, out = runs
    scales = [s[2] for s in out["zero1_fp16"]["flatzero"]]
    # window 2, DeepSpeed's rule: growths at iterations 2 and 4, the second after the load
    assert scales == [256.0, 256.0, 512.0, 512.0, 1024.0]


@pytest.mark.parametrize("case", [WS1, ONE])
def test_deepspeed_resumes_at_another_world_size(runs, case):
    _, out = runs
    ours, theirs = ran(out, case)["flatzero"], ran(out, case)["deepspeed"]
    worst = max(abs(t[0] / o - 1) for t, o in zip(theirs["steps"], ours[K:], strict=True))
    print(f"{case}: largest relative loss difference after the load {worst:.1e}")
    assert [s[0] for s in theirs["steps"]] == pytest.approx(ours[K:], rel=TOLERANCE)
    assert theirs["loaded"]["global_steps"] == K and theirs["loaded"]["epoch"] == 7


@pytest.mark.parametrize("case", [*KERNELS, ONE])
def test_export_is_in_the_format_of_deepspeeds_own_adam(runs, case):
    """DeepSpeed built its own Adam kernel, and the export's groups carry every key a
    fresh one of that class holds (torch's load replaces the groups with the saved ones);
    its state is kept as that class keeps it (``step`` an int)."""
    root, out = runs
    own = ran(out, case)["deepspeed"]["loaded"]["optimizer"]
    assert own["class"] == KERNELS.get(case, "FusedAdam")
    assert own["state"]["step"] == "int"
    directory = root / case / "ds" / read_latest(root / case / "ds")
    for file in sorted(directory.glob("*optim_states.pt")):
        base = ds_pickle.load(file)["optimizer_state_dict"]["base_optimizer_state"]
        for group in base["param_groups"]:
            assert own["group"] <= set(group), file.name
            assert group["bias_correction"] is True and group["decoupled_weight_decay"] is True
        for state in base["state"].values():
            assert {
                k: structure(v)[:2] if k != "step" else structure(v) for k, v in state.items()
            } == {
                "step": "int",
                "exp_avg": ("tensor", torch.float32),
                "exp_avg_sq": ("tensor", torch.float32),
            }
            assert state["step"] == K


# --------------------------------------------------------------- DeepSpeed's own tools
@pytest.mark.parametrize("case", [*CASES, WS1])
def test_zero_to_fp32_equals_flatzero_export(runs, case):
    root, out = runs
    theirs = ran(out, case)["zero_to_fp32"]
    export = export_checkpoint(
        root / case / "fz", root / case / "hf", config=ExportConfig(dtype="fp32", include_tied=True)
    )
    ours = load_file(str(export.out_dir / export.files[0]))
    assert set(ours) == set(theirs)
    with CheckpointReader(root / case / "fz") as reader:
        trained = {reader.meta.model_names.get(n, n) for n in reader.index}
    assert trained == {n for n in theirs if n not in ("gate", "temperature", "head.weight")}
    for name, tensor in ours.items():
        if name in trained:
            assert theirs[name].dtype == torch.float32 and torch.equal(theirs[name], tensor), name
        else:
            assert torch.equal(theirs[name].float(), tensor), name
    assert torch.equal(theirs["head.weight"], theirs["embed.weight"])


def structure(value):
    """``value`` without its numbers: tensors as dtype and shape, DeepSpeed's records as
    their class and attribute names."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape))
    if isinstance(value, dict):
        return {k: structure(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [structure(v) for v in value]
    if isinstance(value, ZeroStage):
        return value
    if hasattr(value, "deepspeed_name"):
        return (type(value).__name__, sorted(vars(value)))
    return type(value).__name__


# what flatzero cannot know or writes more of (docs/checkpoints.md)
LOOSER = ("buffer_names", "frozen_param_shapes", "frozen_param_fragments", "lr_scheduler")


@pytest.mark.parametrize("case", [*CASES, WS1])
def test_export_is_laid_out_as_deepspeeds_own_checkpoint(runs, case):
    """DeepSpeed's own save after the load: the same keys, types, shapes, partitions,
    paddings and fragment addresses as the export, rank by rank."""
    root, out = runs
    ran(out, case)
    ours = root / case / "ds" / read_latest(root / case / "ds")
    theirs = root / case / "ds_after" / f"global_step{K + M}"
    for name in sorted(p.name for p in theirs.glob("*optim_states.pt")):
        mine, its = ds_pickle.load(ours / name), ds_pickle.load(theirs / name)
        maps = [f["optimizer_state_dict"].pop("param_slice_mappings") for f in (mine, its)]
        assert structure(mine) == structure(its), name
        mine, its = mine["optimizer_state_dict"], its["optimizer_state_dict"]
        for key in ("group_paddings", "param_alignment_paddings", "partition_count"):
            assert mine[key] == its[key]
        for pads, a, b in zip(its["param_alignment_paddings"], *maps, strict=True):
            # DeepSpeed 0.19.8 maps a round-robin group without alignment padding as if
            # its params were in their original order (link_hp_params gets no offsets)
            if case != "zero2_bf16" or any(pads):
                assert a == b
    mine, its = (ds_pickle.load(d / "mp_rank_00_model_states.pt") for d in (ours, theirs))
    if case == WS1:  # a PyTorch-door checkpoint does not count samples: DeepSpeed derives it
        its.pop("global_samples")
    assert {k: structure(v) for k, v in mine.items() if k not in LOOSER} == {
        k: structure(v) for k, v in its.items() if k not in LOOSER
    }
    assert set(its["buffer_names"]) <= set(mine["buffer_names"])
    if its["frozen_param_shapes"] is not None:
        assert set(its["frozen_param_shapes"]) <= set(mine["frozen_param_shapes"])
    if mine["lr_scheduler"] is not None:
        assert mine["lr_scheduler"]["last_batch_iteration"] == K - 1
        assert its["lr_scheduler"] == {"last_batch_iteration": K + M - 1}


# ------------------------------------------------------------------------ round trips
def tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out |= {f"{file.name}:{k}": v for k, v in load_file(str(file)).items()}
    return out


@pytest.mark.parametrize("case", [c for c in [*CASES, WS1] if c not in KERNELS])
def test_round_trip_through_deepspeed_is_bitwise(runs, case):
    root, _ = runs
    source = root / case / "fz"
    with CheckpointReader(source) as reader:
        meta, tag = reader.meta, reader.tag
    cfg = case_config(case) | {"train_micro_batch_size_per_gpu": BATCH // meta.world_size}
    cfg["zero_optimization"] = {"stage": cfg["zero_optimization"]["stage"]}  # plain order
    to_deepspeed(source, root / case / "ds_rt", world_size=meta.world_size, ds_config=cfg)
    back = from_deepspeed(
        root / case / "ds_rt", root / case / "back", bucket_numel=meta.layout.bucket_numel
    )
    with CheckpointReader(root / case / "back") as reader:
        again = reader.meta
    assert again.layout.digest() == meta.layout.digest()
    assert again.groups == meta.groups
    assert again.loss_scaler == meta.loss_scaler and again.scheduler == meta.scheduler
    assert again.aliases == meta.aliases and again.stage == meta.stage
    for key in ("flatzero_engine", "client_state"):
        if key in meta.extra:
            assert again.extra[key] == meta.extra[key]
    if "flatzero_engine" not in meta.extra:
        assert again.extra["client_state"] == meta.extra  # a PyTorch-door extra
    ours, theirs = tensors(source / tag), tensors(back)
    assert set(ours) == set(theirs)
    for key, tensor in ours.items():
        assert torch.equal(theirs[key], tensor), key


# ------------------------------------------------- DeepSpeed's checkpoints, read safely
@pytest.mark.parametrize("case", [*CASES, WS1, ONE])
def test_deepspeed_checkpoints_import(runs, case):
    root, out = runs
    expected = ran(out, case)["zero_to_fp32_after"]
    ds = read_deepspeed(root / case / "ds_after")
    assert ds.world_size == (1 if case == ONE else 2)
    assert ds.stage == (CASES[case][0] if case in CASES else 1)
    path = from_deepspeed(root / case / "ds_after", root / case / "imported")
    with CheckpointReader(path) as reader:
        reader.verify()
        for name in reader.index:
            assert torch.equal(reader.read_param(name), expected[name]), name
        extra, scaler = reader.meta.extra, reader.meta.loss_scaler
    assert extra["client_state"] == {"epoch": 8}
    assert extra["flatzero_engine"]["global_steps"] == K + M
    if case == "zero1_fp16":
        assert scaler["scale"] == ran(out, case)["deepspeed"]["steps"][-1][2]


@pytest.mark.parametrize("where", ["model_states", "optim_states"])
def test_crafted_pickle_runs_nothing(tmp_path, where):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    tag = tmp_path / "ds" / "global_step1"
    tag.mkdir(parents=True)
    (tmp_path / "ds" / "latest").write_text("global_step1")
    model = {"module": {}, "param_shapes": [], "dp_world_size": 1}
    optim = {"optimizer_state_dict": {"single_partition_of_fp32_groups": []}}
    (model if where == "model_states" else optim)["payload"] = Payload()
    torch.save(model, tag / "mp_rank_00_model_states.pt")
    torch.save(optim, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    refused = r"pickles posix\.system \(module 'posix', name 'system'\).*nothing in the file ran"
    with pytest.raises(ValueError, match=refused):
        from_deepspeed(tmp_path / "ds", tmp_path / "out")
    assert not marker.exists()
    assert not (tmp_path / "out").exists()
    # the payload is live: an unrestricted load runs it
    torch.load(tag / f"{'mp_rank_00' if where == 'model_states' else 'zero_pp_rank_0_mp_rank_00'}"
               f"_{where}.pt", weights_only=False)  # fmt: skip
    assert marker.exists()


# ------------------------------------------------- without DeepSpeed: errors, Trainer
@pytest.fixture()
def trainer_dir(tmp_path) -> Path:
    """A Trainer-like ``checkpoint-1``: a flatzero checkpoint (one rank, bf16, one AdamW
    step, ``global_step1``) beside the Trainer's files."""
    model, _ = build("bf16", seed=0)
    opt = ZeroOptimizer(
        [(n, p) for n, p in model.named_parameters() if p.requires_grad],
        torch.optim.AdamW,
        flatten_config=FlattenConfig(bucket_numel=400, progress=False),
        lr=LR,
    )
    model(batch(0, 0, 1)).backward()
    opt.step()
    directory = tmp_path / "checkpoint-1"
    save_checkpoint(directory, opt, "global_step1", model=model)
    opt.close()
    (directory / "trainer_state.json").write_text('{"global_step": 1}')
    (directory / "scheduler.pt").write_bytes(b"\x80\x02scheduler")
    (directory / "rng_state_0.pth").write_bytes(b"\x80\x02rng")
    (directory / "tokenizer").mkdir()
    (directory / "tokenizer" / "vocab.txt").write_text("a b c")
    (directory / ".tmp-global_step2-abc").mkdir()
    return directory


def test_trainer_directory_is_copied_beside(trainer_dir, tmp_path):
    out = tmp_path / "checkpoint-1-ds"
    result = to_deepspeed(trainer_dir, out, world_size=3)
    assert result.copied == ("rng_state_0.pth", "scheduler.pt", "tokenizer", "trainer_state.json")
    assert sorted(p.name for p in out.iterdir()) == [
        "global_step1",
        "latest",
        "rng_state_0.pth",
        "scheduler.pt",
        "tokenizer",
        "trainer_state.json",
    ]
    for name in ("rng_state_0.pth", "scheduler.pt", "trainer_state.json", "tokenizer/vocab.txt"):
        assert (out / name).read_bytes() == (trainer_dir / name).read_bytes()
    assert (out / "latest").read_text().strip() == "global_step1"
    assert sorted(p.name for p in (out / "global_step1").iterdir()) == [
        f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(3)
    ] + ["mp_rank_00_model_states.pt"]
    ds = read_deepspeed(out)
    assert (ds.world_size, ds.stage) == (3, 2)
    # three partitions of the same masters, bit for bit
    with CheckpointReader(trainer_dir) as reader:
        fetch = ds.index()
        for name in reader.index:
            whole = torch.cat(
                [
                    ds.optim_state(seg.source[0])["single_partition_of_fp32_groups"][seg.source[1]][
                        seg.offset : seg.offset + seg.param_end - seg.param_start
                    ]
                    for seg in fetch[name].segments
                ]
            )
            assert torch.equal(whole.view(reader.read_param(name).shape), reader.read_param(name))
    with pytest.raises(ValueError, match=r"already holds \['global_step1'"):
        to_deepspeed(trainer_dir, out, world_size=3)
    assert to_deepspeed(trainer_dir, out, world_size=2, overwrite=True).world_size == 2
    inside = trainer_dir / "to_deepspeed"  # an output inside the directory is never copied
    to_deepspeed(trainer_dir, inside, world_size=1)
    again = to_deepspeed(trainer_dir, inside, world_size=1, overwrite=True)
    atomic.wait_for_removals()  # the replaced copy is deleted in the background
    assert "to_deepspeed" not in again.copied and sorted(p.name for p in inside.iterdir()) == [
        "global_step1",
        "latest",
        "rng_state_0.pth",
        "scheduler.pt",
        "tokenizer",
        "trainer_state.json",
    ]


def test_bad_input_errors(trainer_dir, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"global_step9 does not exist.*tags here: global_step1"):
        to_deepspeed(trainer_dir, out, world_size=2, tag="global_step9")
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        to_deepspeed(trainer_dir, out, world_size=0)
    cfg = config(2, "bf16", scheduler=False)
    with pytest.raises(
        ValueError,
        match=r"world size 3 does not fit .* DeepSpeed needs train_batch_size = "
        r"train_micro_batch_size_per_gpu \* gradient_accumulation_steps \* world size, and "
        r"train_batch_size 4 is not 2 \* 1 \* 3 = 6",
    ):
        to_deepspeed(trainer_dir, out, world_size=3, ds_config=cfg)
    del cfg["train_micro_batch_size_per_gpu"]
    with pytest.raises(ValueError, match="train_batch_size 4 is not a multiple of 3"):
        to_deepspeed(trainer_dir, out, world_size=3, ds_config=cfg)
    for kind in ("Lamb", "Adagrad"):  # Adagrad offloaded: DeepSpeedCPUAdagrad
        bad = config(2, "bf16", scheduler=False) | {"optimizer": {"type": kind, "params": {}}}
        bad["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        with pytest.raises(ValueError, match=f"'{kind}'.*its own kernels"):
            to_deepspeed(trainer_dir, out, world_size=2, ds_config=bad)
    uncorrected = {"type": "AdamW", "params": {"bias_correction": False}}
    with pytest.raises(ValueError, match="bias_correction is false"):
        to_deepspeed(trainer_dir, out, world_size=2, ds_config=cfg | {"optimizer": uncorrected})
    sgd = config(2, "bf16", scheduler=False) | {"optimizer": {"type": "SGD", "params": {}}}
    with pytest.raises(
        ValueError, match=r"builds torch\.optim\.SGD but the checkpoint's optimizer is AdamW"
    ):
        to_deepspeed(trainer_dir, out, world_size=2, ds_config=sgd)
    with pytest.raises(
        ValueError, match=r"trained in torch\.bfloat16 but ds_config trains in torch\.float16"
    ):
        to_deepspeed(trainer_dir, out, world_size=2, ds_config=config(2, "fp16", False))
    accumulating = config(1, "bf16", False) | {"data_types": {"grad_accum_dtype": "fp32"}}
    with pytest.raises(ValueError, match="BF16_Optimizer"):
        to_deepspeed(trainer_dir, out, world_size=2, ds_config=accumulating)
    assert not out.exists() or not any(out.iterdir())


# What DeepSpeed 0.19.8's Adam classes read from a param group (their ``__init__`` defaults
# and ``step``; FusedAdam also sets a group ``step``); both keep ``step`` as an int.
KERNEL_GROUP_KEYS = {
    "FusedAdam": {"lr", "bias_correction", "betas", "eps", "weight_decay", "step"},
    "DeepSpeedCPUAdam": {"lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad"},
}


@pytest.mark.parametrize(
    ("section", "offload", "written"),
    [
        (None, False, "FusedAdam"),  # no config: DeepSpeed's default for AdamW
        ({"type": "AdamW"}, False, "FusedAdam"),
        ({"type": "Adam", "params": {"lr": 1e-3}}, True, "DeepSpeedCPUAdam"),  # adam_w_mode
        ({"type": "AdamW", "params": {"torch_adam": True}}, True, "AdamW"),
        ({"type": "Adam", "params": {"adam_w_mode": False}}, False, "Adam"),
    ],
)
def test_optimizer_state_in_the_format_deepspeed_builds(
    trainer_dir, tmp_path, section, offload, written
):
    cfg = None if section is None else config(2, "bf16", False) | {"optimizer": section}
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if written == "Adam":  # configured Adam in L2 mode: the checkpoint trained AdamW
        with pytest.raises(ValueError, match=r"builds FusedAdam \(Adam\) but .* is AdamW"):
            to_deepspeed(trainer_dir, tmp_path / "out", world_size=2, ds_config=cfg)
        return
    to_deepspeed(trainer_dir, tmp_path / "out", world_size=2, ds_config=cfg)
    saved = ds_pickle.load(
        tmp_path / "out" / "global_step1" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    )
    base = saved["optimizer_state_dict"]["base_optimizer_state"]
    (group,), inner = base["param_groups"], base["state"][0]
    assert group["lr"] == LR and group["decoupled_weight_decay"] is True  # torch's keys kept
    if written in KERNEL_GROUP_KEYS:
        assert KERNEL_GROUP_KEYS[written] <= set(group) and group["bias_correction"] is True
        assert type(inner["step"]) is int and inner["step"] == 1
    else:
        assert "bias_correction" not in group and torch.equal(inner["step"], torch.tensor(1.0))
    if section is None:
        assert saved["ds_config"]["optimizer"] == {"type": "AdamW", "params": {}}
        # the same file resumes a client torch AdamW, still decoupled, its step a tensor
        flat = nn.Parameter(torch.zeros(inner["exp_avg"].numel()))
        client = torch.optim.AdamW([flat], lr=1.0, weight_decay=0.5)
        client.load_state_dict(base)
        assert client.param_groups[0]["decoupled_weight_decay"] is True
        assert torch.equal(client.state[flat]["step"], torch.tensor(1.0))
        # and imports with FusedAdam's keys and int step
        back = from_deepspeed(tmp_path / "out", tmp_path / "back")
        with CheckpointReader(back) as reader:
            record = reader.meta.groups[0]
        assert record.hyperparams["bias_correction"] is True and record.scalars["step"] == 1


@pytest.mark.parametrize(
    ("cls", "options", "problem"),
    [
        (torch.optim.AdamW, {"amsgrad": True}, r"FusedAdam \(AdamW\).*amsgrad=True"),
        (torch.optim.Adam, {"decoupled_weight_decay": True}, r"FusedAdam \(Adam\).*decoupled"),
    ],
)
def test_groups_deepspeeds_adam_cannot_continue_are_refused(tmp_path, cls, options, problem):
    model, _ = build("fp32", seed=0)
    opt = ZeroOptimizer(
        [(n, p) for n, p in model.named_parameters() if p.requires_grad],
        cls,
        flatten_config=FlattenConfig(bucket_numel=400, progress=False),
        **options,
    )
    model(batch(0, 0, 1)).backward()
    opt.step()
    save_checkpoint(tmp_path / "ckpt", opt, model=model)
    opt.close()
    with pytest.raises(ValueError, match=problem + ".*torch_adam"):
        to_deepspeed(tmp_path / "ckpt", tmp_path / "out", world_size=2)
    torch_adam = {
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": cls.__name__, "params": {"torch_adam": True, "adam_w_mode": False}},
    }
    assert to_deepspeed(tmp_path / "ckpt", tmp_path / "out", world_size=2, ds_config=torch_adam)


def test_hugging_face_auto_values(trainer_dir, tmp_path):
    """A Trainer's config with unresolved "auto" values: checked where it is concrete,
    ``clip_grad`` left to the run."""
    cfg = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto", "loss_scale_window": 500},
        "zero_optimization": {"stage": 2, "allgather_bucket_size": "auto"},
    }
    to_deepspeed(trainer_dir, tmp_path / "auto", world_size=2, ds_config=cfg)
    state = ds_pickle.load(
        tmp_path / "auto" / "global_step1" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    )
    assert "clip_grad" not in state["optimizer_state_dict"] and state["ds_config"] == cfg
    with pytest.raises(ValueError, match="gradient_clipping is 'none'"):
        to_deepspeed(
            trainer_dir,
            tmp_path / "bad",
            world_size=2,
            ds_config=cfg | {"gradient_clipping": "none"},
        )


class Lion(torch.optim.Optimizer):
    """An elementwise optimizer torch.optim does not have (sign of a momentum)."""

    def __init__(self, params, lr: float = 1e-4) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg"].mul_(0.9).add_(p.grad, alpha=0.1)
                p.add_(state["exp_avg"].sign(), alpha=-group["lr"])


def test_optimizer_deepspeed_cannot_load_is_named(tmp_path):
    model, _ = build("fp32", seed=0)
    opt = ZeroOptimizer(
        [(n, p) for n, p in model.named_parameters() if p.requires_grad],
        Lion,
        elementwise_optimizer=True,
        flatten_config=FlattenConfig(bucket_numel=400, progress=False),
    )
    model(batch(0, 0, 1)).backward()
    opt.step()
    save_checkpoint(tmp_path / "ckpt", opt, model=model)
    opt.close()
    with pytest.raises(ValueError, match=r"optimizer is 'Lion'.*any_optimizer=True"):
        to_deepspeed(tmp_path / "ckpt", tmp_path / "out", world_size=2)
    result = to_deepspeed(tmp_path / "ckpt", tmp_path / "out", world_size=2, any_optimizer=True)
    state = read_deepspeed(tmp_path / "out").inner_state(1, 0)
    assert (
        set(state) == {"exp_avg"}
        and state["exp_avg"].numel()
        == read_deepspeed(tmp_path / "out").layout.groups[0].shard_numel
    )
    assert result.stage == 2


def test_cli(trainer_dir, tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["export-deepspeed", str(trainer_dir), str(out), "--world-size", "2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"wrote DeepSpeed ZeRO-2 checkpoint {out / 'global_step1'} for 2 ranks" in printed
    assert "copied rng_state_0.pth, scheduler.pt, tokenizer, trainer_state.json" in printed
    assert main(argv) == 2
    assert "already holds" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{not json")
    assert main([*argv, "--overwrite", "--ds-config", str(tmp_path / "bad.json")]) == 2
    assert "bad.json' is not valid JSON" in capsys.readouterr().err
    (tmp_path / "ds.json").write_text(
        '{"zero_optimization": {"stage": 1}, "bf16": {"enabled": true}}'
    )
    assert main([*argv, "--overwrite", "--ds-config", str(tmp_path / "ds.json")]) == 0
    assert read_deepspeed(out).stage == 1
    with open_safetensors(trainer_dir / "global_step1" / "model_rest.safetensors") as rest:
        assert set(rest.keys()) == {"gate", "temperature"}
