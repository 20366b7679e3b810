"""Checkpoints across world sizes: train at 4 ranks, save, resume at 1, 2, 3 and 4 ranks.

One spawn at world size 4 trains ``K`` steps, saves, runs ``M`` more steps (the
uninterrupted reference), then resumes from the checkpoint in the same processes: at
world size 4 with the same bucket size (must be bitwise equal to the reference), at
world size 4 with another bucket size and ZeRO stage 1, and at world sizes 2 and 3
through process groups of the first 2 and 3 ranks (a ``ZeroOptimizer`` over a 2-rank
group has a world-size-2 layout, exactly as under a 2-process launch; this saves two
spawns). World size 1 resumes in this process. The loaded state (master weights and
AdamW moments of every param, gathered) must equal the saved one bit for bit
everywhere; the next steps must match the reference within 1e-6 relative. The same
checkpoint, copied and damaged, serves the error tests. Killed saves: a 2-rank spawn
whose rank 1 is SIGKILLed while writing its file, and a forked process killed after
writing everything but before publishing.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from flatzero import FlattenConfig
from flatzero.checkpoint import (
    CheckpointReader,
    ExportConfig,
    LoadConfig,
    SaveConfig,
    export_checkpoint,
    load_checkpoint,
    read_latest,
    save_checkpoint,
)
from flatzero.checkpoint.atomic import set_fault_hook
from flatzero.comm import rank_of
from flatzero.launch import run_ranks
from flatzero.models import LlamaConfig, build_model
from flatzero.optim import ZeroConfig, ZeroOptimizer
from flatzero.storage.tensorfile import TensorFile
from tiny_configs import TINY_LLAMA

K = 3  # steps before the save
M = 2  # steps after it
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4
SEQ = 10
BUCKET = 3000
OTHER_BUCKET = 1100


def make(bucket: int = BUCKET, stage: int = 2, pg=None):
    """A tiny Llama with tied embeddings and a frozen norm, two param groups, AdamW with
    clipping, and an LR schedule."""
    model = build_model(TINY_LLAMA, device="cpu", dtype=torch.float32, seed=0, tie_embeddings=True)
    model.model.layers[0].input_layernorm.weight.requires_grad_(False)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [(n, p) for n, p in named if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [(n, p) for n, p in named if p.dim() < 2], "weight_decay": 0.0, "lr": 5e-3},
    ]
    opt = ZeroOptimizer(
        groups,
        torch.optim.AdamW,
        stage=stage,
        process_group=pg,
        config=ZeroConfig(max_grad_norm=1.0),
        flatten_config=FlattenConfig(bucket_numel=bucket, progress=False),
        lr=3e-3,
        betas=(0.9, 0.95),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.5 * s))
    return model, opt, sched


def batches() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, TINY_LLAMA.vocab_size, (K + M, GLOBAL_BATCH, SEQ), generator=g)


def train_step(model, opt, sched, step: int) -> float:
    """One step on this rank's part of the global batch; returns the global mean loss."""
    rank, ws = opt.rank, opt.world_size
    per = GLOBAL_BATCH // ws
    ids = batches()[step, rank * per : (rank + 1) * per]
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    value = loss.detach().clone()
    if ws > 1:
        dist.all_reduce(value, group=opt.flat.process_group)
        value /= ws
    return float(value)


def full_state(opt) -> dict[str, torch.Tensor]:
    """Every param's master value and AdamW moments, gathered from all ranks, by name."""
    ws = opt.world_size
    sd = opt.state_dict()
    out: dict[str, torch.Tensor] = {}
    for gi, gl in enumerate(opt.flat.layout.groups):
        tensors = {"master": sd["master"][gi]}
        inner = sd["optimizer"]["state"].get(gi, {})
        tensors |= {k: v for k, v in inner.items() if v.dim() > 0}
        out[f"group{gi}/step"] = inner.get("step", torch.tensor(-1.0)).reshape(1).clone()
        for state, shard in tensors.items():
            shards = [torch.empty_like(shard) for _ in range(ws)]
            if ws > 1:
                dist.all_gather(shards, shard.contiguous(), group=opt.flat.process_group)
            else:
                shards = [shard]
            for si, slot in enumerate(gl.slots):
                value = torch.empty(slot.numel)
                for r, piece in gl.param_pieces(si):
                    value[piece.param_start : piece.param_end] = shards[r][
                        piece.shard_start : piece.shard_start + piece.numel
                    ]
                out[f"{slot.spec.name}/{state}"] = value
    out["lr"] = torch.tensor([g["lr"] for g in opt.param_groups])
    return out


def pack(value) -> bytes:
    """Tensors through run_ranks' queue would need the child alive: serialize them."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def unpack(blob: bytes):
    return torch.load(io.BytesIO(blob), weights_only=False)


def resume(ckpt: str, bucket: int, stage: int, pg=None) -> dict | None:
    """Load the checkpoint into a fresh model and run the remaining ``M`` steps."""
    torch.manual_seed(1000 + rank_of(pg))  # anything: loading must not depend on it
    model, opt, sched = make(bucket, stage, pg)
    rank = opt.rank
    result = load_checkpoint(ckpt, opt, scheduler=sched, model=model)
    order = list(opt.state_dict()["bucket_order"])
    rng = torch.rand(4)
    state = full_state(opt)
    losses = [train_step(model, opt, sched, step) for step in range(K, K + M)]
    final = full_state(opt)
    opt.close()
    if rank != 0:
        return None
    return {
        "state": state,
        "losses": losses,
        "final": final,
        "resharded": result.resharded,
        "extra": result.extra,
        "step": result.step,
        "rng": rng,
        "sched": sched.state_dict()["last_epoch"],
        "order": order,
    }


def train_save_resume(rank: int, ws: int, ckpt: str) -> bytes:
    """Reference run with a save after ``K`` steps, then resumes at the same world size."""
    model, opt, sched = make()
    for step in range(K):
        train_step(model, opt, sched, step)
    torch.manual_seed(77 + rank)
    save_checkpoint(
        ckpt,
        opt,
        scheduler=sched,
        model=model,
        extra={"data_step": K},
        config=SaveConfig(save_rng=True),
    )
    rng = torch.rand(4)  # what a resumed run at this world size must draw next
    order = list(opt.state_dict()["bucket_order"])
    state = full_state(opt)
    losses = [train_step(model, opt, sched, step) for step in range(K, K + M)]
    final = full_state(opt)
    opt.close()
    same = resume(ckpt, BUCKET, 2)
    other = resume(ckpt, OTHER_BUCKET, 1)
    first2, first3 = dist.new_group([0, 1]), dist.new_group([0, 1, 2])
    at2 = resume(ckpt, BUCKET, 2, first2) if rank < 2 else None
    at3 = resume(ckpt, OTHER_BUCKET, 2, first3) if rank < 3 else None
    dist.barrier()
    if rank != 0:
        return pack(None)
    return pack(
        {
            "state": state,
            "losses": losses,
            "final": final,
            "rng": rng,
            "order": order,
            "same": same,
            "other": other,
            2: at2,
            3: at3,
        }
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict]:
    ckpt = tmp_path_factory.mktemp("ckpt") / "run"
    out = unpack(run_ranks(train_save_resume, 4, str(ckpt))[0])
    return ckpt, out


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def assert_close_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rel: float) -> float:
    """Every tensor of ``a`` within ``rel`` of ``b`` in relative L2 norm; returns the worst."""
    worst = 0.0
    for k in b:
        err = float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30))
        worst = max(worst, err)
        assert err <= rel, f"{k}: relative error {err:.3g}"
    return worst


def test_checkpoint_layout_on_disk(reference):
    ckpt, _ = reference
    assert read_latest(ckpt) == f"step{K}"
    files = sorted(os.listdir(ckpt / f"step{K}"))
    assert files == [
        "meta.json",
        "model_rest.safetensors",
        *[f"rank_0000{r}-of-00004.safetensors" for r in range(4)],
    ]
    meta = json.loads((ckpt / f"step{K}" / "meta.json").read_text())
    assert meta["world_size"] == 4 and meta["optimizer"] == "AdamW"
    assert meta["groups"][0]["states"] == ["master", "exp_avg", "exp_avg_sq"]
    assert meta["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".tmp-")]
    with CheckpointReader(ckpt) as reader:
        reader.verify()
        assert "model.layers.0.input_layernorm.weight" not in reader.index  # frozen: rest


def test_resume_at_same_world_size_is_bitwise(reference):
    _, ref = reference
    same = ref["same"]
    assert not same["resharded"] and same["step"] == K and same["extra"] == {"data_step": K}
    assert_bitwise(same["state"], ref["state"])
    assert same["losses"] == ref["losses"]
    assert_bitwise(same["final"], ref["final"])
    assert torch.equal(same["rng"], ref["rng"])  # RNG states restored at the same size
    assert same["order"] == ref["order"]  # the learned bucket launch order too
    assert same["sched"] == K + M


def test_resume_with_other_bucket_size_and_stage(reference):
    _, ref = reference
    other = ref["other"]
    assert other["resharded"]
    assert_bitwise(other["state"], ref["state"])
    assert_close_rel(other["final"], ref["final"], 1e-6)


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_resume_at_other_world_size(reference, ws):
    ckpt, ref = reference
    out = resume(str(ckpt), BUCKET, 2) if ws == 1 else ref[ws]
    assert out["resharded"]
    assert_bitwise(out["state"], ref["state"])
    assert out["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    assert_close_rel(out["final"], ref["final"], 1e-6)


def test_export_of_the_world_size_4_checkpoint(reference, tmp_path):
    ckpt, ref = reference
    result = export_checkpoint(ckpt, tmp_path / "out", config=ExportConfig(dtype="fp32"))
    state = load_file(str(tmp_path / "out" / result.files[0]))
    with CheckpointReader(ckpt) as reader:
        names = list(reader.index)
    for name in names:
        assert torch.equal(state[name].reshape(-1), ref["state"][f"{name}/master"]), name
    model = build_model(TINY_LLAMA, device="cpu", dtype=torch.float32, seed=5, tie_embeddings=True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # tied: stored once


# ------------------------------------------------------------------------------ errors
def snapshot(opt) -> dict[str, torch.Tensor]:
    state = full_state(opt)
    state |= {
        f"bucket{i}": b.clone() for i, b in enumerate(b for g in opt.flat.groups for b in g.buckets)
    }
    return state


@pytest.fixture()
def damaged(reference, tmp_path) -> Path:
    """A private copy of the reference checkpoint directory, to damage."""
    ckpt, _ = reference
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    return copy


def expect_error_and_nothing_changed(ckpt: Path, match: str, config=None, **kwargs) -> None:
    _, opt, sched = make()
    before = snapshot(opt)
    with pytest.raises(ValueError, match=match):
        load_checkpoint(ckpt, opt, scheduler=sched, config=config, **kwargs)
    assert_bitwise(snapshot(opt), before)


def test_truncated_rank_file(damaged):
    path = damaged / f"step{K}" / "rank_00002-of-00004.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    expect_error_and_nothing_changed(damaged, "rank_00002-of-00004.safetensors.*truncated")


def test_missing_rank_file(damaged):
    (damaged / f"step{K}" / "rank_00003-of-00004.safetensors").unlink()
    expect_error_and_nothing_changed(damaged, "rank_00003-of-00004.safetensors is missing")


def test_corrupt_header(damaged):
    path = damaged / f"step{K}" / "rank_00001-of-00004.safetensors"
    data = bytearray(path.read_bytes())
    data[8:40] = b"x" * 32
    path.write_bytes(bytes(data))
    expect_error_and_nothing_changed(damaged, "rank_00001-of-00004.safetensors.*damaged")


def test_corrupt_data_found_by_checksum(damaged):
    path = damaged / f"step{K}" / "rank_00000-of-00004.safetensors"
    with TensorFile(path) as f:
        info = f.info("g0.exp_avg")
    data = bytearray(path.read_bytes())
    at = info.offset + info.nbytes // 2
    data[at : at + 10] = bytes(10)
    path.write_bytes(bytes(data))
    expect_error_and_nothing_changed(damaged, "rank_00000-of-00004.safetensors.*checksum")


def test_damaged_meta_and_latest(damaged):
    (damaged / f"step{K}" / "meta.json").write_text('{"format": "flatzero.checkpoint/1", "tag"')
    expect_error_and_nothing_changed(damaged, "meta.json cannot be read")
    (damaged / "latest").write_text("nope\n")
    expect_error_and_nothing_changed(damaged, "step3|nope")


def test_file_from_another_checkpoint(damaged, tmp_path):
    _, opt, _ = make()
    other = save_checkpoint(tmp_path / "other", opt, tag="x")  # world size 1
    src = other / "rank_00000-of-00001.safetensors"
    dst = damaged / f"step{K}" / "rank_00000-of-00004.safetensors"
    # same size, other content: pad the stray file so the size check passes
    data = src.read_bytes()
    data += b"\0" * (dst.stat().st_size - len(data))
    dst.write_bytes(data)
    expect_error_and_nothing_changed(damaged, "rank_00000-of-00004.safetensors.*(another|damaged)")


def test_model_that_does_not_match(reference):
    ckpt, _ = reference
    wide = LlamaConfig(**{**TINY_LLAMA.__dict__, "intermediate_size": 96})
    model = build_model(wide, device="cpu", dtype=torch.float32, seed=0, tie_embeddings=True)
    opt = ZeroOptimizer(
        model.named_parameters(),
        torch.optim.AdamW,
        lr=1e-3,
        flatten_config=FlattenConfig(bucket_numel=BUCKET, progress=False),
    )
    before = snapshot(opt)
    with pytest.raises(ValueError, match=r"mlp.*shape \(32, 96\).*\(32, 64\)"):
        load_checkpoint(ckpt, opt)
    assert_bitwise(snapshot(opt), before)


def test_renamed_params_and_non_strict(reference):
    ckpt, ref = reference

    class Wrapper(torch.nn.Module):
        def __init__(self, lm, extra: bool) -> None:
            super().__init__()
            self.lm = lm
            if extra:
                self.head2 = torch.nn.Parameter(torch.ones(5))

    model = build_model(TINY_LLAMA, device="cpu", dtype=torch.float32, seed=3, tie_embeddings=True)
    model.model.layers[0].input_layernorm.weight.requires_grad_(False)
    wrapped = Wrapper(model, extra=True)
    opt = ZeroOptimizer(
        [(n, p) for n, p in wrapped.named_parameters() if p.requires_grad],
        torch.optim.AdamW,
        lr=1e-3,
        flatten_config=FlattenConfig(bucket_numel=BUCKET, progress=False),
    )
    with pytest.raises(ValueError, match="head2"):
        load_checkpoint(ckpt, opt, rename=lambda n: n.removeprefix("lm."))
    load_checkpoint(
        ckpt, opt, rename=lambda n: n.removeprefix("lm."), config=LoadConfig(strict=False)
    )
    masters = opt.full_params()
    assert torch.equal(masters["head2"], torch.ones(5))
    for name, value in masters.items():
        if name != "head2":
            assert torch.equal(
                value.reshape(-1), ref["state"][name.removeprefix("lm.") + "/master"]
            )


def test_existing_tag_is_not_overwritten(damaged):
    _, opt, _ = make()
    target = damaged / f"step{K}"
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    with pytest.raises(ValueError, match="already exists"):
        save_checkpoint(damaged, opt, tag=f"step{K}")
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert not [p for p in damaged.iterdir() if p.name.startswith(".tmp-")]


# ------------------------------------------------------------------------ killed saves
def save_then_die(rank: int, ws: int, ckpt: str) -> None:
    """Save ``a``; then save ``b`` and get killed while writing rank 1's file."""
    model, opt, sched = make()
    train_step(model, opt, sched, 0)
    save_checkpoint(ckpt, opt, tag="a")
    train_step(model, opt, sched, 1)
    written = []

    def die(point: str, r: int) -> None:
        if point == "tensor_written" and r == 1:
            written.append(point)
            if len(written) == 2:
                os.kill(os.getpid(), signal.SIGKILL)

    set_fault_hook(die)
    save_checkpoint(ckpt, opt, tag="b")


def resume_then_die_before_publish(ckpt: str) -> None:
    """(Forked child, no process group.) Load ``latest`` at another world size, then die
    after writing everything of ``c`` but before the rename that publishes it."""
    torch.set_num_threads(1)
    model, opt, sched = make()
    load_checkpoint(ckpt, opt)
    train_step(model, opt, sched, 2)

    def die(point: str, r: int) -> None:
        if point == "before_publish":
            os.kill(os.getpid(), signal.SIGKILL)

    set_fault_hook(die)
    save_checkpoint(ckpt, opt, tag="c")
    os._exit(0)  # not reached


def test_killed_saves_leave_the_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "run"
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        run_ranks(save_then_die, 2, str(ckpt), timeout_s=20)
    assert read_latest(ckpt) == "a"
    assert not (ckpt / "b").exists()
    # the surviving rank 0 sees the collective fail and removes the unfinished save; had it
    # been killed too, a .tmp-b-* directory without meta.json would remain (ignored)
    leftovers = [p for p in ckpt.iterdir() if p.name not in ("a", "latest")]
    assert all(p.name.startswith(".tmp-b-") for p in leftovers)
    assert not any((p / "meta.json").exists() for p in leftovers)

    child = multiprocessing.get_context("fork").Process(
        target=resume_then_die_before_publish, args=(str(ckpt),)
    )
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert read_latest(ckpt) == "a" and not (ckpt / "c").exists()
    (tmp_c,) = [p for p in ckpt.iterdir() if p.name.startswith(".tmp-c-")]
    assert (tmp_c / "meta.json").exists()  # complete, but never published

    _, opt, _ = make()
    result = load_checkpoint(ckpt, opt)  # the previous checkpoint loads
    assert result.tag == "a" and result.step == 1 and result.saved_world_size == 2
    with CheckpointReader(ckpt) as reader:
        reader.verify()
    # a later save removes the leftovers of killed saves
    save_checkpoint(ckpt, opt, tag="d", config=SaveConfig(stale_tmp_age_s=0))
    assert sorted(p.name for p in ckpt.iterdir()) == ["a", "d", "latest"]
    assert read_latest(ckpt) == "d"
