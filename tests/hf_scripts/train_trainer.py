"""An ordinary Hugging Face Trainer script: nothing of flatzero in it.

A tiny Llama built from a config (no downloads), a fixed synthetic dataset, every setting
from the command line (``TrainingArguments``: ``--deepspeed ds_config.json`` and the rest).
After training it evaluates on a held-out set and saves the model. Writes the Trainer's
``log_history`` and the evaluation metrics to ``OUTPUT_DIR/log_history.json`` on the main
process, and on every rank ``OUTPUT_DIR/rank<R>.json``: the world size the Trainer and its
Accelerator see and a checksum of the trained weights. ``--resume DIR`` resumes from a
checkpoint directory.
"""

from __future__ import annotations

import json
import os

import torch
from torch._dynamo.utils import counters
from transformers import (
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, seq: int = 16, vocab: int = 128, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = HfArgumentParser(TrainingArguments)
    parser.add_argument("--resume", default=None)
    args, extra = parser.parse_args_into_dataclasses()
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
    trainer = Trainer(model=model, args=args, train_dataset=Data(), eval_dataset=Data(n=8, seed=2))
    trainer.train(resume_from_checkpoint=extra.resume)
    metrics = trainer.evaluate()
    trainer.save_model(args.output_dir)
    with open(os.path.join(args.output_dir, f"rank{args.process_index}.json"), "w") as f:
        seen = {
            "world_size": args.world_size,
            "num_processes": trainer.accelerator.num_processes,
            "checksum": sum(p.detach().double().sum().item() for p in model.parameters()),
        }
        json.dump(seen, f)
    if trainer.is_world_process_zero():
        with open(os.path.join(args.output_dir, "log_history.json"), "w") as f:
            json.dump(
                {
                    "engine": type(trainer.model_wrapped).__name__,
                    "compiled": bool(getattr(trainer.model_wrapped, "is_compiled", False)),
                    "graph_breaks": sum(counters["graph_break"].values()),
                    "graphs": counters["stats"]["unique_graphs"],
                    "log_history": trainer.state.log_history,
                    "eval": metrics,
                },
                f,
            )


if __name__ == "__main__":
    main()
