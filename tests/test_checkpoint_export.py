"""``flatzero export``: consolidated safetensors loadable with load_state_dict / transformers.

Export from a multi-rank checkpoint is covered in test_checkpoint_distributed.py (on the
world-size-4 reference checkpoint); here a world-size-1 run in this process.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file

from flatzero import FlattenConfig
from flatzero.checkpoint import ExportConfig, export_checkpoint, save_checkpoint
from flatzero.checkpoint.export import export_main
from flatzero.checkpoint_options import add_export_arguments
from flatzero.cli_types import parse_size
from flatzero.models import build_model
from flatzero.optim import ZeroOptimizer
from tiny_configs import TINY_LLAMA


def trained_checkpoint(tmp_path, dtype=torch.bfloat16):
    model = build_model(TINY_LLAMA, device="cpu", dtype=dtype, seed=0, tie_embeddings=True)
    model.model.norm.weight.requires_grad_(False)  # frozen: exported from the model's rest
    opt = ZeroOptimizer(
        model.named_parameters(),
        torch.optim.AdamW,
        lr=1e-2,
        flatten_config=FlattenConfig(bucket_numel=2000, progress=False),
    )
    ids = torch.randint(
        0, TINY_LLAMA.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0)
    )
    for _ in range(2):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, opt, model=model)
    return model, opt, ckpt


def load_export(out, files) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state |= load_file(str(out / f))
    return state


def test_export_sharded_fp32_equals_masters_and_loads(tmp_path):
    model, opt, ckpt = trained_checkpoint(tmp_path)
    masters = opt.full_params()
    out = tmp_path / "export"
    result = export_checkpoint(ckpt, out, config=ExportConfig(dtype="fp32", max_shard_bytes=9000))
    assert len(result.files) > 2 and result.index == "model.safetensors.index.json"
    index = json.loads((out / result.index).read_text())
    assert set(index["weight_map"].values()) == set(result.files)
    state = load_export(out, result.files)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in state.values())
    for f in result.files:  # bounded size, except a tensor bigger than the bound alone
        tensors = load_file(str(out / f))
        assert len(tensors) == 1 or sum(t.nbytes for t in tensors.values()) <= 9000
    for name, value in masters.items():
        assert torch.equal(state[name], value), name
    assert torch.equal(state["model.norm.weight"], model.model.norm.weight.float())
    assert "lm_head.weight" not in state  # tied: stored once, as HF does

    fresh = build_model(TINY_LLAMA, device="cpu", dtype=torch.float32, seed=7, tie_embeddings=True)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight


def test_export_bf16_single_file_with_tied_names(tmp_path):
    model, opt, ckpt = trained_checkpoint(tmp_path)
    masters = opt.full_params()
    out = tmp_path / "export"
    result = export_checkpoint(ckpt, out, config=ExportConfig(dtype="bf16", include_tied=True))
    assert result.files == ("model.safetensors",) and result.index is None
    state = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    fresh = build_model(TINY_LLAMA, device="cpu", dtype=torch.bfloat16, seed=7, tie_embeddings=True)
    fresh.load_state_dict(state, strict=True)
    for name, value in masters.items():
        assert torch.equal(state[name], value.to(torch.bfloat16)), name
    # the bf16 params trained in flatzero are the bf16 cast of the masters too
    for name, p in model.named_parameters():
        assert torch.equal(state[name], p.detach()), name


def test_export_cli(tmp_path, capsys):
    _, _, ckpt = trained_checkpoint(tmp_path)
    parser = argparse.ArgumentParser()
    add_export_arguments(parser)
    out = tmp_path / "cli"
    args = parser.parse_args([str(ckpt), str(out), "--dtype", "fp32", "--max-shard-size", "8KB"])
    assert export_main(args) == 0
    assert "model.safetensors.index.json" in capsys.readouterr().out
    with pytest.raises(ValueError, match="already holds"):  # nothing overwritten
        export_main(args)
    args = parser.parse_args([str(ckpt), str(out), "--overwrite", "--verify"])
    assert export_main(args) == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("1000") == 1000
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("five")


def test_export_loads_with_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    opt = ZeroOptimizer(
        model.named_parameters(),
        torch.optim.AdamW,
        lr=1e-2,
        flatten_config=FlattenConfig(bucket_numel=3000, progress=False),
    )
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, opt, model=model)
    out = tmp_path / "hf"
    export_checkpoint(ckpt, out, config=ExportConfig(dtype="fp32", max_shard_bytes=20000))
    config.save_pretrained(out)
    loaded = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_export_feeds_direct_load(tmp_path):
    from flatzero.loading import load_flat

    model, _, ckpt = trained_checkpoint(tmp_path)
    out = tmp_path / "export"
    export_checkpoint(ckpt, out, config=ExportConfig(dtype="bf16", max_shard_bytes=9000))
    meta = build_model(TINY_LLAMA, device="meta", dtype=torch.bfloat16, tie_embeddings=True)
    load_flat(meta, out, config=FlattenConfig(bucket_numel=1500, device="cpu", progress=False))
    trained = dict(model.named_parameters())
    for name, p in meta.named_parameters():
        assert torch.equal(p.detach(), trained[name].detach()), name
