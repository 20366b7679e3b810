"""Checkpoints of a ZeroOptimizer on CUDA: device tensors streamed to the rank file
through pinned chunks, loaded back onto the device (skipped without CUDA; run with
``FLATZERO_TEST_GPU=1``, as the CPU suite hides the GPUs)."""

from __future__ import annotations

import pytest
import torch

from flatzero import FlattenConfig
from flatzero.checkpoint import CheckpointReader, load_checkpoint, save_checkpoint
from flatzero.models import LlamaConfig, build_model
from flatzero.optim import ZeroOptimizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA (run with FLATZERO_TEST_GPU=1)"
    ),
]

LLAMA = LlamaConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)


def make(bucket: int):
    model = build_model(LLAMA, device="cuda", dtype=torch.bfloat16, seed=0)
    opt = ZeroOptimizer(
        model.named_parameters(),
        torch.optim.AdamW,
        lr=1e-3,
        flatten_config=FlattenConfig(bucket_numel=bucket, device="cuda", progress=False),
    )
    return model, opt


def test_save_and_load_on_cuda(tmp_path):
    model, opt = make(20000)
    ids = torch.randint(0, 96, (2, 16), device="cuda")
    for _ in range(2):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    save_checkpoint(tmp_path, opt, model=model)
    with CheckpointReader(tmp_path) as reader:
        reader.verify()  # crc32 computed while streaming from the device
        for name, value in opt.full_params().items():
            assert torch.equal(reader.read_param(name), value.cpu()), name

    model2, opt2 = make(7000)
    load_checkpoint(tmp_path, opt2, model=model2)
    for (name, a), (_, b) in zip(model.named_parameters(), model2.named_parameters(), strict=True):
        assert b.device.type == "cuda" and torch.equal(a, b), name
    sd1, sd2 = opt.state_dict()["optimizer"], opt2.state_dict()["optimizer"]
    assert sd2["state"][0]["exp_avg"].device.type == "cuda"
    assert float(sd1["state"][0]["step"]) == float(sd2["state"][0]["step"]) == 2
    model2(ids, labels=ids).loss.backward()
    opt2.step()
