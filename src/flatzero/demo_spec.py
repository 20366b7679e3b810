"""The settings of ``flatzero demo`` and its options, apart from the demo itself so that
``flatzero demo --help`` (and an argument error) answers without importing torch."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from .cli_types import count

__all__ = ["DemoSpec", "add_arguments"]


@dataclass(frozen=True)
class DemoSpec:
    """The demo's settings (the same on every rank).

    Attributes:
        world_size: ranks of the training run.
        steps: optimizer steps.
        layers, hidden, experts, vocab: the model's cut-down Qwen3-30B-A3B shape (the
            text is bytes: a vocab under 256 folds them, ``byte % vocab``).
        micro_batch: sequences per micro-batch per rank.
        grad_accum: micro-batches per optimizer step.
        seq_len: tokens (bytes) per sequence.
        held_out: held-out sequences the loss is measured on after every step.
        trials: timed flatten trials per method (the median is shown), after one untimed
            round that takes the one-time costs (imports, first collectives) out.
        door_model: the ``flatzero bench doors`` model the doors are compared on.
        door_trials: launches per door (0: skip the door comparison).
        bucket_numel: flatten and reduce bucket size (elements).
        out: directory for the checkpoint, the plot and ``demo.json``.
    """

    world_size: int = 2
    steps: int = 20
    layers: int = 2
    hidden: int = 256
    experts: int = 16
    vocab: int = 256
    micro_batch: int = 4
    grad_accum: int = 2
    seq_len: int = 64
    held_out: int = 16
    trials: int = 5
    bucket_numel: int = 2**22
    door_model: str = "qwen3-moe-narrow-unfused"
    door_trials: int = 1
    out: str = "flatzero-demo"

    def model_config(self) -> Any:
        """The model's config: Qwen3-30B-A3B cut down."""
        from .models import scaled

        return scaled(
            "qwen3-30b-a3b",
            layers=self.layers,
            hidden=self.hidden,
            heads=4,
            kv_heads=2,
            head_dim=self.hidden // 4,
            intermediate=self.hidden // 2,
            experts=self.experts,
            top_k=2,
            vocab=self.vocab,
            expert_layout="unfused",
        )

    def ds_config(self) -> dict[str, Any]:
        """The DeepSpeed config the model is trained with."""
        return {
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.grad_accum,
            "train_batch_size": self.micro_batch * self.grad_accum * self.world_size,
            "zero_optimization": {"stage": 2, "reduce_bucket_size": self.bucket_numel},
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01},
            },
            "scheduler": {
                "type": "WarmupLR",
                "params": {"warmup_min_lr": 3e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 5},
            },
            "gradient_clipping": 1.0,
            "steps_per_print": 10,
            # Unused experts leave buckets incomplete until the end of backward.
            "flatzero": {"progress": False, "reduce_staging_buffers": 4},
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``flatzero demo`` options."""
    d = DemoSpec()
    parser.add_argument(
        "--world-size", type=count(1, 64), default=d.world_size, help="ranks to spawn"
    )
    parser.add_argument(
        "--steps", type=count(0, 1_000_000), default=d.steps, help="optimizer steps"
    )
    parser.add_argument("--layers", type=count(1, 1000), default=d.layers, help="decoder layers")
    parser.add_argument("--hidden", type=int, default=d.hidden, help="hidden size")
    parser.add_argument(
        "--experts", type=count(1, 1024), default=d.experts, help="experts per MoE layer"
    )
    parser.add_argument("--vocab", type=int, default=d.vocab, help="vocabulary size (tokens)")
    parser.add_argument(
        "--trials", type=count(1, 1000), default=d.trials, help="timed inits per method"
    )
    parser.add_argument("--bucket-numel", type=int, default=d.bucket_numel, help="elements")
    parser.add_argument(
        "--door-trials", type=int, default=d.door_trials, help="launches per door (0: skip)"
    )
    parser.add_argument("--out", default=d.out, help="directory for checkpoint, plot, JSON")
