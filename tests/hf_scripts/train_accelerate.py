"""An ordinary Accelerate loop with DeepSpeed ZeRO-2: nothing of flatzero in it.

The learning rate comes from a ``LambdaLR`` built over the client optimizer (Accelerate's
usual pattern; Accelerate does not hand it to ``deepspeed.initialize``). The schedule has a
step with lr 0, at which the weights must not move. Writes, per optimizer step, the
micro-batch losses, the lr, the gradient norm, whether the step was skipped and a checksum
of the weights to ``sys.argv[1]`` (main process). Then ``save_state``, one more step, and
``load_state``: the weights and lr must be those saved.
"""

from __future__ import annotations

import json
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin
from transformers import LlamaConfig, LlamaForCausalLM

LAMBDAS = [1.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.25, 0.25, 0.1, 0.1, 0.05]
"""Accelerate steps the scheduler once per process per optimizer step (2 ranks: 2 entries)."""


def main() -> None:
    out = sys.argv[1]
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 4096},
        "zero_force_ds_cpu_optimizer": False,
    }
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config), gradient_accumulation_steps=2
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: LAMBDAS[min(s, len(LAMBDAS) - 1)])
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (32, 16), generator=g)
    loader = torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=2)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)

    def checksum() -> float:
        weights = accelerator.unwrap_model(model).parameters()
        return float(sum(p.detach().double().sum() for p in weights))

    records, losses = [], []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            losses.append(loss.item())
            opt.step()
            sched.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            records.append(
                {
                    "losses": losses,
                    "lr": sched.get_last_lr()[0],
                    "grad_norm": float(norm),
                    "skipped": opt.step_was_skipped,
                    "checksum": checksum(),
                }
            )
            losses = []
    state = {"saved": (checksum(), sched.get_last_lr()[0])}
    accelerator.save_state(out + ".state")
    for batch in list(loader)[:2]:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            opt.step()
            sched.step()
            opt.zero_grad()
    state["moved"] = (checksum(), sched.get_last_lr()[0])
    accelerator.load_state(out + ".state")
    state["restored"] = (checksum(), sched.get_last_lr()[0])
    if accelerator.is_main_process:
        with open(out, "w") as f:
            json.dump({"engine": type(model).__name__, "records": records, "state": state}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
