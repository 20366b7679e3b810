"""Damaged checkpoints at 2 ranks (issue 24 items 2-3): refused on every rank, naming the
newest tag that is complete and verifies, or loaded by ``fallback="newest_valid"``.

One 2-rank spawn saves ``global_step1`` and ``global_step2`` and then, per damage, copies
the directory, damages ``global_step2`` in it and loads it on both ranks: 16 bytes XOR-ed
inside rank 1's ``g0.master`` (size unchanged: only the checksum sees it, and only rank 1
reads that file), rank 0's file truncated, rank 1's file deleted, ``latest`` naming a tag
that does not exist.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flatzero import FlattenConfig
from flatzero.checkpoint import LoadConfig, load_checkpoint, save_checkpoint
from flatzero.launch import run_ranks
from flatzero.optim import ZeroOptimizer
from flatzero.storage.tensorfile import TensorFile

DAMAGES = ("flipped", "truncated", "missing", "latest_missing")
GOOD, BAD = "global_step1", "global_step2"


def make() -> tuple[torch.nn.Module, ZeroOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    opt = ZeroOptimizer(
        model.named_parameters(),
        torch.optim.AdamW,
        lr=1e-2,
        flatten_config=FlattenConfig(bucket_numel=256, progress=False),
    )
    return model, opt


def step(model: torch.nn.Module, opt: ZeroOptimizer, i: int) -> None:
    g = torch.Generator().manual_seed(100 * i + opt.rank)
    model(torch.randn(4, 16, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def damage(root: Path, how: str) -> None:
    bad = root / BAD
    if how == "flipped":
        path = bad / "rank_00001-of-00002.safetensors"
        with TensorFile(path) as f:
            info = f.info("g0.master")
        data = bytearray(path.read_bytes())
        middle = info.offset + info.nbytes // 2  # a param's elements, not the padding
        for i in range(middle, middle + 16):
            data[i] ^= 0xA5
        path.write_bytes(bytes(data))
    elif how == "truncated":
        path = bad / "rank_00000-of-00002.safetensors"
        path.write_bytes(path.read_bytes()[:-100])
    elif how == "missing":
        (bad / "rank_00001-of-00002.safetensors").unlink()
    else:
        (root / "latest").write_text("global_step9\n")


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def attempt(root: Path, config: LoadConfig, saved: dict[str, dict]) -> dict:
    """Load ``root`` into a fresh optimizer: the error and whether the params stayed, or
    the tag loaded and which saved state the params equal."""
    _, opt = make()
    before = opt.full_params()
    try:
        result = load_checkpoint(root, opt, config=config)
    except ValueError as error:
        unchanged = same(before, opt.full_params())
        opt.close()
        return {"error": f"{type(error).__name__}: {error}", "unchanged": unchanged}
    after = opt.full_params()
    opt.close()
    return {"tag": result.tag, "equals": [t for t, p in saved.items() if same(p, after)]}


def damaged_loads(rank: int, ws: int, base: str) -> dict:
    root = Path(base) / "run"
    model, opt = make()
    step(model, opt, 0)
    save_checkpoint(root, opt, tag=GOOD)
    saved = {GOOD: opt.full_params()}
    step(model, opt, 1)
    save_checkpoint(root, opt, tag=BAD)
    saved[BAD] = opt.full_params()
    opt.close()
    out: dict = {}
    for how in DAMAGES:
        copy = Path(base) / how
        if rank == 0:
            shutil.copytree(root, copy)
            damage(copy, how)
        dist.barrier()
        out[how] = attempt(copy, LoadConfig(), saved)
        out[how, "fallback"] = attempt(copy, LoadConfig(fallback="newest_valid"), saved)
    flipped = Path(base) / "flipped"
    out["flipped", "unverified"] = attempt(flipped, LoadConfig(verify=False), saved)
    return out


def newest_good(how: str) -> str:
    """The tag a damage leaves as the newest good one (``latest`` naming a missing tag
    damages no checkpoint)."""
    return BAD if how == "latest_missing" else GOOD


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list[dict]:
    return run_ranks(damaged_loads, 2, str(tmp_path_factory.mktemp("damage")), timeout_s=120)


@pytest.mark.parametrize("how", DAMAGES)
def test_refused_on_every_rank_naming_the_good_tag(outcomes, how):
    what = {
        "flipped": r"rank_00001-of-00002.safetensors: tensor 'g0.master' fails its checksum",
        "truncated": r"rank_00000-of-00002.safetensors has \d+ bytes but .* records",
        "missing": r"rank_00001-of-00002.safetensors is missing",
        "latest_missing": r"global_step9 does not exist or is incomplete",
    }[how]
    good = newest_good(how)
    way_out = rf"{good} is complete and verifies: load_checkpoint\(.*, tag='{good}'\)"
    for rank, out in enumerate(outcomes):
        error = out[how]["error"]
        assert error.startswith("CheckpointDamaged: ") and out[how]["unchanged"], error
        assert re.search(way_out, error), error
        if how == "flipped" and rank == 0:  # rank 0 read only its own, intact file
            assert "failed on another rank" in error
        else:
            assert re.search(what, error), error


@pytest.mark.parametrize("how", DAMAGES)
def test_fallback_loads_the_good_tag(outcomes, how):
    good = newest_good(how)
    for out in outcomes:
        loaded = out[how, "fallback"]
        assert loaded.get("tag") == good, loaded.get("error")
        assert loaded["equals"] == [good]


def test_unverified_load_takes_the_flipped_bytes(outcomes):
    """Without verification the damaged checkpoint loads, wrong: what the checksum stops."""
    for out in outcomes:
        loaded = out["flipped", "unverified"]
        assert loaded.get("tag") == BAD and loaded["equals"] == []


def test_fallback_warns_and_an_undamaged_directory_has_no_way_out(tmp_path, caplog):
    model, opt = make()
    step(model, opt, 0)
    save_checkpoint(tmp_path, opt, tag=GOOD)
    (tmp_path / "latest").write_text("global_step9\n")
    with caplog.at_level(logging.WARNING, logger="flatzero.checkpoint.load"):
        result = load_checkpoint(tmp_path, opt, config=LoadConfig(fallback="newest_valid"))
    assert result.tag == GOOD and "global_step9" in caplog.text and GOOD in caplog.text
    shutil.rmtree(tmp_path / GOOD)
    with pytest.raises(ValueError, match=r"no other checkpoint in .* is complete and verifies"):
        load_checkpoint(tmp_path, opt)
    with pytest.raises(ValueError, match="fallback must be one of"):
        LoadConfig(fallback="newest")
