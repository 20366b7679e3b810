"""A meta-device model initialized straight from safetensors into the flat buffers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from flatzero import FlattenConfig, SafetensorsCheckpoint, load_flat
from flatzero.launch import run_ranks
from flatzero.models import build_model, save_model_safetensors, scaled

CONFIG = scaled(
    "qwen3-30b-a3b", layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, intermediate=32,
    experts=4, top_k=2, vocab=300, expert_layout="unfused",
)  # fmt: skip


class WithBuffers(nn.Module):
    """A persistent buffer (in the checkpoint), a computed one (not), a frozen param."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(37, 29)
        self.frozen = nn.Parameter(torch.randn(5), requires_grad=False)
        self.register_buffer("running", torch.randn(7))
        self.register_buffer("table", torch.arange(11.0) * 2, persistent=False)


def _save_model(path) -> dict[str, torch.Tensor]:
    model = build_model(CONFIG, device="cpu", dtype=torch.bfloat16, seed=3)
    save_model_safetensors(model, path)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _load_worker(rank: int, world_size: int, path: str, tier: str) -> dict:
    expected = {n: t for n, t in SafetensorsCheckpoint(path).entries.items()}
    ckpt = SafetensorsCheckpoint(path)
    model = build_model(CONFIG, device="meta", dtype=torch.bfloat16)
    flat = load_flat(
        model, ckpt, config=FlattenConfig(tier=tier, bucket_numel=20_000, progress=False)
    )
    for name, p in model.named_parameters():
        assert p.device.type == "cpu"
        assert torch.equal(p, ckpt.read(name).view(p.shape)), name
    shard_bytes = sum(g.shard_numel for g in flat.layout.groups) * 2
    return {
        "read": flat.report.bytes_moved["host_copy"],
        "shard_bytes": shard_bytes,
        "gathered": flat.report.bytes_moved["all_gather"],
        "tensors": len(expected),
    }


@pytest.mark.parametrize("world_size", [1, 3])
def test_sharded_direct_load_reads_only_each_ranks_slice(tmp_path, world_size):
    path = tmp_path / "model.safetensors"
    _save_model(path)
    results = run_ranks(_load_worker, world_size, str(path), "sharded")
    for r in results:
        # Host copies: the rank's own slices read from the file (at most one shard, never
        # the whole model) plus the master shard built from them (one shard).
        assert r["read"] <= 2 * r["shard_bytes"]
        if world_size > 1:
            assert r["gathered"] > 0


def test_cpu_tier_loads_an_hf_style_sharded_directory(tmp_path):
    model = build_model(CONFIG, device="cpu", dtype=torch.float32, seed=5)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = sorted(state)
    half = len(names) // 2
    files = {"model-00001-of-00002.safetensors": names[:half],
             "model-00002-of-00002.safetensors": names[half:]}  # fmt: skip
    for file, keys in files.items():
        save_file({k: state[k] for k in keys}, tmp_path / file)
    index = {"weight_map": {k: f for f, ks in files.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    meta = build_model(CONFIG, device="meta", dtype=torch.bfloat16)  # stored fp32, loaded bf16
    load_flat(meta, tmp_path, config=FlattenConfig(progress=False))
    for name, p in meta.named_parameters():
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, state[name].to(torch.bfloat16)), name


def test_buffers_frozen_params_and_key_map(tmp_path):
    source = WithBuffers()
    state = {f"base.{k}": v for k, v in source.state_dict().items()}
    save_file(state, tmp_path / "m.safetensors")
    with torch.device("meta"):
        model = WithBuffers()

    def init_buffers(m: WithBuffers) -> None:
        m.table.copy_(torch.arange(11.0) * 2)

    load_flat(model, tmp_path / "m.safetensors", key_map=lambda n: f"base.{n}",
              init_buffers=init_buffers, config=FlattenConfig(progress=False))  # fmt: skip
    for name, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    assert torch.equal(model.table, torch.arange(11.0) * 2)
    assert not model.frozen.requires_grad


def test_missing_computed_buffer_is_named(tmp_path):
    save_file(WithBuffers().state_dict(), tmp_path / "m.safetensors")
    with torch.device("meta"):
        model = WithBuffers()
    with pytest.raises(ValueError, match="buffers table are on the meta device"):
        load_flat(model, tmp_path / "m.safetensors", config=FlattenConfig(progress=False))


def test_wrong_model_and_missing_keys_are_named_and_change_nothing(tmp_path):
    path = tmp_path / "model.safetensors"
    _save_model(path)
    other = build_model(scaled(CONFIG, vocab=301), device="meta", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"embed_tokens.weight' has shape"):
        load_flat(other, path, config=FlattenConfig(progress=False))
    assert all(p.device.type == "meta" for p in other.parameters())
    model = build_model(CONFIG, device="meta", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"has no tensor 'x.model.embed_tokens.weight'"):
        load_flat(model, path, key_map=lambda n: "x." + n, config=FlattenConfig(progress=False))


def test_truncated_and_corrupt_files_are_named(tmp_path):
    path = tmp_path / "model.safetensors"
    _save_model(path)
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut.safetensors is truncated"):
        SafetensorsCheckpoint(tmp_path / "cut.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match=r"bad.safetensors is not a valid safetensors file"):
        SafetensorsCheckpoint(tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="does not exist"):
        SafetensorsCheckpoint(tmp_path / "nowhere")


def test_read_into_converts_and_checks_ranges(tmp_path):
    t = torch.randn(6, 7)
    save_file({"t": t}, tmp_path / "t.safetensors")
    ckpt = SafetensorsCheckpoint(tmp_path / "t.safetensors")
    out = torch.empty(10, dtype=torch.bfloat16)
    ckpt.read_into("t", 5, 15, out)
    assert torch.equal(out, t.view(-1)[5:15].to(torch.bfloat16))
    with pytest.raises(ValueError, match="outside tensor"):
        ckpt.read_into("t", 40, 50, out)
