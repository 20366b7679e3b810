"""``model_rest.safetensors`` (frozen params and buffers) is checksummed in ``meta.json``
and verified on load like the rank files (issue 24): a flipped byte is refused naming the
good tag, and the fallback loads that tag. One process, no spawn."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from flatzero import FlattenConfig
from flatzero.checkpoint import (
    CheckpointDamaged,
    CheckpointReader,
    LoadConfig,
    load_checkpoint,
    save_checkpoint,
)
from flatzero.checkpoint.checkpointer import wait_for_save
from flatzero.optim import ZeroOptimizer


def make() -> tuple[torch.nn.Module, ZeroOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4)
    )
    model[0].weight.requires_grad_(False)  # frozen: saved in model_rest with the BN buffers
    opt = ZeroOptimizer(
        model.named_parameters(),
        torch.optim.AdamW,
        lr=1e-2,
        flatten_config=FlattenConfig(bucket_numel=256, progress=False),
    )
    return model, opt


def step(model: torch.nn.Module, opt: ZeroOptimizer, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    model(torch.randn(6, 8, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def rest_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if k.startswith(("0.", "1."))}


def flip_data_byte(path) -> None:
    data = bytearray(path.read_bytes())
    header = struct.unpack("<Q", data[:8])[0]
    data[8 + header + 5] ^= 0x10  # inside the first tensor's bytes; size unchanged
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_flipped_byte_in_model_rest_is_refused_naming_the_good_tag(tmp_path, asynchronous):
    model, opt = make()
    step(model, opt, 0)
    at_a = rest_of(model)
    save_checkpoint(tmp_path, opt, tag="a", model=model)
    model[0].weight.data.add_(1.0)  # the frozen weight and the BN statistics change
    step(model, opt, 1)
    save_checkpoint(tmp_path, opt, tag="b", model=model, asynchronous=asynchronous)
    wait_for_save(opt)

    record = json.loads((tmp_path / "b" / "meta.json").read_text())["model_rest_record"]
    assert set(record["tensors"]) == {"0.weight", "1.running_mean", "1.running_var"} | {
        "1.num_batches_tracked"
    }
    assert all(t["checksum"]["algorithm"] for t in record["tensors"].values())
    with CheckpointReader(tmp_path, "b") as reader:
        reader.verify()  # intact: every chunk of the rank file and of the model rest

    flip_data_byte(tmp_path / "b" / "model_rest.safetensors")
    fresh, fresh_opt = make()
    with pytest.raises(CheckpointDamaged) as refused:
        load_checkpoint(tmp_path, fresh_opt, model=fresh)
    message = str(refused.value)
    assert "model_rest.safetensors" in message and "fails its checksum" in message
    assert "a is complete and verifies: load_checkpoint(" in message
    assert all(torch.equal(v, rest_of(make()[0])[k]) for k, v in rest_of(fresh).items())
    with pytest.raises(CheckpointDamaged, match=r"model_rest\.safetensors"):
        CheckpointReader(tmp_path, "b").verify()  # flatzero export --verify's check

    result = load_checkpoint(
        tmp_path, fresh_opt, model=fresh, config=LoadConfig(fallback="newest_valid")
    )
    assert result.tag == "a"
    assert all(torch.equal(v, at_a[k]) for k, v in rest_of(fresh).items())
    # opting out of verification loads the damaged file without a word
    assert load_checkpoint(tmp_path, fresh_opt, model=fresh, config=LoadConfig(verify=False))
