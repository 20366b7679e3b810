"""DeepSpeed ZeRO-2 checkpoints import into flatzero and resume with matching losses.

Needs DeepSpeed 0.19.x (skipped without it). One 2-rank spawn trains a small model with
the real ``deepspeed.initialize`` (ZeRO-2, CPU accelerator, client ``torch.optim.AdamW``)
for ``K`` steps in fp32 and in bf16, saves with ``engine.save_checkpoint``, runs ``M``
more steps (the reference losses), imports the checkpoint with ``from_deepspeed``
(rank 0, offline) and resumes it with ``ZeroOptimizer`` at world size 2 in the same
processes. World size 1 resumes in this process. The imported fp32 master weights must
equal DeepSpeed's own consolidation (``zero_to_fp32``) exactly.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flatzero import FlattenConfig
from flatzero.checkpoint import CheckpointReader, export_checkpoint, load_checkpoint
from flatzero.deepspeed.convert import from_deepspeed
from flatzero.deepspeed.reader import read_deepspeed
from flatzero.launch import run_ranks
from flatzero.optim import ZeroConfig, ZeroOptimizer
from flatzero.testing.deepspeed import deepspeed_available

K = 3
M = 3
BATCH = 4  # global batch; split over 1 or 2 ranks
SEQ = 12
VOCAB = 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LR = 3e-3


class Tiny(nn.Module):
    """Embedding, a residual MLP with odd widths (partitions cut params in the middle),
    an untied head and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 24)
        self.fc1 = nn.Linear(24, 37)
        self.fc2 = nn.Linear(37, 24)
        self.norm = nn.LayerNorm(24)
        self.head = nn.Linear(24, VOCAB, bias=False)
        self.register_buffer("temperature", torch.tensor(0.9))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.fc2(torch.relu(self.fc1(h)))
        logits = self.head(self.norm(h)).float() / self.temperature.float()
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)
        )


def batch(step: int, rank: int, ws: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(99)
    data = torch.randint(0, VOCAB, (K + M, BATCH, SEQ), generator=g)
    per = BATCH // ws
    return data[step, rank * per : (rank + 1) * per]


def global_mean(loss: torch.Tensor, ws: int, group=None) -> float:
    value = loss.detach().float().clone()
    if ws > 1:
        dist.all_reduce(value, group=group)
        value /= ws
    return float(value)


def ds_config(dtype: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": BATCH // 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 2**31 - 1,
        "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": 700,
            "allgather_bucket_size": 700,
        },
        "bf16": {"enabled": dtype == "bf16"},
    }


def train_deepspeed(rank: int, ws: int, ckpt: Path, dtype: str) -> list[float]:
    """K steps, save, M more steps with DeepSpeed; returns the last M global losses."""
    import deepspeed

    from flatzero.testing.deepspeed import release_engine

    torch.manual_seed(0)
    model = Tiny().to(DTYPES[dtype])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(dtype))
        for step in range(K):
            loss = engine(batch(step, rank, ws))
            engine.backward(loss)
            engine.step()
        engine.save_checkpoint(str(ckpt), client_state={"epoch": 7})
    losses = []
    for step in range(K, K + M):
        loss = engine(batch(step, rank, ws))
        losses.append(global_mean(loss, ws))
        engine.backward(loss)
        engine.step()
    release_engine(engine)
    return losses


def resume_flatzero(ckpt: Path, dtype: str) -> dict:
    """Load the imported checkpoint into a fresh model and run the last M steps."""
    torch.manual_seed(123)  # another init: everything must come from the checkpoint
    model = Tiny().to(DTYPES[dtype])
    model.temperature.fill_(5.0)
    reduce = torch.bfloat16 if dtype == "bf16" else torch.float32
    opt = ZeroOptimizer(
        model.named_parameters(),
        torch.optim.AdamW,
        config=ZeroConfig(max_grad_norm=1.0, reduce_dtype=reduce),
        flatten_config=FlattenConfig(bucket_numel=500, progress=False),
        lr=1.0,  # restored from the checkpoint
        betas=(0.9, 0.95),
        weight_decay=0.1,
    )
    result = load_checkpoint(ckpt, opt, model=model)
    rank, ws = opt.rank, opt.world_size
    lr = opt.param_groups[0]["lr"]
    temperature = float(model.temperature)
    losses = []
    for step in range(K, K + M):
        loss = model(batch(step, rank, ws))
        losses.append(global_mean(loss, ws, opt.flat.process_group))
        loss.backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    return {
        "losses": losses,
        "lr": lr,
        "temperature": temperature,
        "extra": result.extra,
        "step": result.step,
    }


def deepspeed_then_flatzero(rank: int, ws: int, root: str) -> bytes:
    from flatzero.testing.deepspeed import prepare_deepspeed

    prepare_deepspeed(warmup=False)
    out = {}
    for dtype in DTYPES:
        ds_dir = Path(root) / f"ds_{dtype}"
        fz_dir = Path(root) / f"fz_{dtype}"
        ds_losses = train_deepspeed(rank, ws, ds_dir, dtype)
        dist.barrier()
        if rank == 0:
            from_deepspeed(ds_dir, fz_dir, bucket_numel=300)
        dist.barrier()
        out[dtype] = {"deepspeed": ds_losses, "flatzero": resume_flatzero(fz_dir, dtype)}
    buffer = io.BytesIO()
    torch.save(out if rank == 0 else None, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict]:
    ok, why = deepspeed_available()
    if not ok:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("ds")
    blob = run_ranks(deepspeed_then_flatzero, 2, str(root), timeout_s=240)[0]
    return root, torch.load(io.BytesIO(blob), weights_only=False)


# At world size 2 flatzero reproduces DeepSpeed's losses to the last bit here (same
# reductions); at world size 1 only the gradient sums' rounding differs.
TOLERANCE_WS2 = {"fp32": 1e-6, "bf16": 1e-6}
TOLERANCE_WS1 = {"fp32": 1e-6, "bf16": 1e-3}


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_deepspeed_zero2_resumes_at_world_size_2(runs, dtype):
    _, out = runs
    ref, got = out[dtype]["deepspeed"], out[dtype]["flatzero"]
    assert got["losses"] == pytest.approx(ref, rel=TOLERANCE_WS2[dtype])
    assert got["lr"] == LR and got["step"] == K
    assert got["temperature"] == pytest.approx(0.9, rel=1e-2)  # buffer restored
    assert got["extra"]["deepspeed"]["global_steps"] == K
    assert got["extra"]["flatzero_engine"]["global_steps"] == K
    assert got["extra"]["client_state"] == {"epoch": 7}


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_deepspeed_zero2_resumes_at_world_size_1(runs, dtype):
    root, out = runs
    got = resume_flatzero(root / f"fz_{dtype}", dtype)
    assert got["losses"] == pytest.approx(out[dtype]["deepspeed"], rel=TOLERANCE_WS1[dtype])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_imported_masters_equal_deepspeed_consolidation(runs, dtype):
    root, _ = runs
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):
        expected = get_fp32_state_dict_from_zero_checkpoint(str(root / f"ds_{dtype}"))
    ds = read_deepspeed(root / f"ds_{dtype}")
    assert ds.world_size == 2 and ds.stage == 2
    with CheckpointReader(root / f"fz_{dtype}") as reader:
        reader.verify()
        assert set(reader.index) == {n for n in expected if n != "temperature"}
        for name in reader.index:
            assert torch.equal(reader.read_param(name), expected[name].float()), name
    # and the import exports to a state dict the model loads
    export = export_checkpoint(root / f"fz_{dtype}", root / f"export_{dtype}")
    from safetensors.torch import load_file

    state = load_file(str(root / f"export_{dtype}" / export.files[0]))
    model = Tiny()
    model.load_state_dict(state)


def test_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="latest"):
        from_deepspeed(tmp_path, tmp_path / "out")
    tag = tmp_path / "global_step1"
    tag.mkdir()
    (tmp_path / "latest").write_text("global_step1")
    with pytest.raises(ValueError, match=r"mp_rank_00_model_states\.pt"):
        from_deepspeed(tmp_path, tmp_path / "out")
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"mp_rank_00_model_states\.pt cannot be read"):
        from_deepspeed(tmp_path, tmp_path / "out")
    torch.save(
        {"module": {}, "param_shapes": [], "dp_world_size": 2}, tag / "mp_rank_00_model_states.pt"
    )
    with pytest.raises(ValueError, match=r"ranks \[0, 1\]"):
        from_deepspeed(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_import_cli_with_another_world_size(runs, capsys):
    import argparse

    from flatzero.checkpoint_options import add_import_deepspeed_arguments
    from flatzero.deepspeed.convert.cli import import_main

    root, _ = runs
    parser = argparse.ArgumentParser()
    add_import_deepspeed_arguments(parser)
    out = root / "fz_cli"
    args = parser.parse_args(
        [str(root / "ds_fp32"), str(out), "--world-size", "3", "--bucket-numel", "100"]
    )
    assert import_main(args) == 0
    assert "wrote flatzero checkpoint" in capsys.readouterr().out
    with pytest.raises(ValueError, match="already exists"):  # nothing overwritten
        import_main(args)
    huge = parser.parse_args(
        [str(root / "ds_fp32"), str(root / "fz_huge"), "--world-size", "65536"]
    )
    with pytest.raises(ValueError, match=r"world size 65536 for \d+ elements: .* padding only"):
        import_main(huge)  # refused before anything is written
    assert not (root / "fz_huge").exists()
    with CheckpointReader(out) as three, CheckpointReader(root / "fz_fp32") as two:
        assert three.meta.world_size == 3 and two.meta.world_size == 2
        for name in two.index:
            assert torch.equal(three.read_param(name), two.read_param(name))
            assert torch.equal(
                three.read_param(name, "exp_avg_sq"), two.read_param(name, "exp_avg_sq")
            )
