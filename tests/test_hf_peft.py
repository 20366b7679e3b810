"""A peft LoRA model through ``flatzero.initialize`` (the ``hf`` extra installs
peft; skipped where it is missing; docs/huggingface.md says which version ran it).

A tiny transformers Llama wrapped by ``peft.get_peft_model`` holds frozen base weights and
trainable LoRA matrices. Through the DeepSpeed door at ZeRO-2, one rank, fp32, the LoRA
matrices train to plain ``torch.optim.AdamW``'s values over 2 steps and the base weights
stay bit for bit what they were: only trainable params are flattened and stepped.
"""

from __future__ import annotations

import pytest
import torch

from flatzero.launch import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("peft")

STEPS = 2
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "flatzero": {"progress": False},
}


def make():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(base, lora)
    for name, param in model.named_parameters():  # LoRA's B starts at zero: move it off
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return model


def batches() -> torch.Tensor:
    return torch.randint(0, 128, (STEPS, 2, 16), generator=torch.Generator().manual_seed(3))


def rank_main(rank: int, world_size: int) -> dict:
    import flatzero

    model = make()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    engine, opt, _, _ = flatzero.initialize(model=model, config=CONFIG)
    losses = []
    for batch in batches():
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = dict(model.named_parameters())
    out = {
        "losses": losses,
        "trainable": trainable,
        "frozen": len(frozen),
        "frozen_unchanged": all(torch.equal(params[n].detach(), v) for n, v in frozen.items()),
        "flattened": sorted(opt.full_params()),
        "lora": {n: params[n].detach().tolist() for n in trainable},
    }
    engine.destroy()
    return out


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.01)
    losses = []
    for batch in batches():
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = dict(model.named_parameters())
    return losses, {n: params[n].detach() for n, p in params.items() if p.requires_grad}


def test_a_lora_model_trains_its_adapters_only_as_plain_adamw_does():
    got = run_ranks(rank_main, 1)[0]
    assert got["trainable"] and all("lora_" in n for n in got["trainable"])
    assert got["frozen"] > 0 and got["frozen_unchanged"]
    assert sorted(got["flattened"]) == sorted(got["trainable"])  # nothing frozen flattened
    losses, lora = reference()
    assert got["losses"] == pytest.approx(losses, rel=1e-6)
    for name, value in lora.items():
        torch.testing.assert_close(
            torch.tensor(got["lora"][name]), value, rtol=1e-5, atol=1e-6, msg=name
        )
