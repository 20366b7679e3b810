"""DeepSpeed issue #7677's repro script, run through flatzero's DeepSpeed door.

The issue (https://github.com/deepspeedai/DeepSpeed/issues/7677): ``deepspeed.initialize``
of Qwen3-30B-A3B cut to 16 layers, ZeRO-2, bf16, took 20m35s on 8 GPUs (2244 CPU-minutes)
against about 3 minutes on one. The script below is the issue's, with its import line
``import sys, deepspeed, torch`` changed to ``import sys, flatzero as deepspeed, torch``.
Two things differ from the issue's text, as the issue itself instructs or to run without
downloads:

- ``train_batch_size`` is the world size (the issue: "change train_batch_size to the world
  size");
- ``--synthetic`` builds the model from the real Qwen3-30B-A3B config values (cut down by
  ``--layers/--hidden/--experts/--vocab``) with random weights instead of downloading it.

Full scale, on a GPU node (downloads the model)::

    time torchrun --nproc-per-node 8 examples/deepspeed_7677.py

Reduced scale, on a CPU machine::

    torchrun --nproc-per-node 2 examples/deepspeed_7677.py --synthetic --layers 2 \\
        --hidden 256 --experts 16 --vocab 8192

It prints the model's tensor count and the init report (tier, phases, bytes moved, peak
memory) on rank 0.

The tensor count is what #7677 is about, and it depends on the transformers version.
transformers 4.x builds each expert as its own three ``nn.Linear``: 6,290 tensors at 16
layers and 128 experts (without the LM head), the issue's case. transformers 5 fuses a
layer's experts into two 3-D tensors (``experts.gate_up_proj``, ``experts.down_proj``):
11 tensors a layer, 178 at 16 layers, whatever the expert count, so under transformers 5
this script does not reproduce the many-tensor case. ``python -m flatzero demo`` does
(door to door on 6,291 tensors, flatzero's own Qwen3-MoE with unfused experts), as does
``flatzero plan --model qwen3-30b-a3b --layers 16 --expert-layout unfused --no-lm-head``.
"""

# ruff: noqa: E401, F401, I001  (the issue's import lines, kept as they were)
import sys, flatzero as deepspeed, torch  # the issue: import sys, deepspeed, torch
from transformers import AutoModel, AutoConfig

import argparse

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--synthetic", action="store_true", help="random weights, no download")
parser.add_argument("--layers", type=int, default=16, help="16 in the issue (of 48)")
parser.add_argument("--hidden", type=int, default=2048, help="--synthetic: hidden size")
parser.add_argument("--experts", type=int, default=128, help="--synthetic: experts per layer")
parser.add_argument("--vocab", type=int, default=151936, help="--synthetic: vocabulary size")
args = parser.parse_args()
world_size = int(__import__("os").environ.get("WORLD_SIZE", "1"))

model = "Qwen/Qwen3-30B-A3B-Instruct-2507"
if args.synthetic:
    # Qwen3-30B-A3B's shape (flatzero's model zoo holds its config.json values), scaled.
    from flatzero.models import get_preset
    from transformers import Qwen3MoeConfig

    real = get_preset("qwen3-30b-a3b")
    heads = max(2, real.num_attention_heads * args.hidden // real.hidden_size)
    c = Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        moe_intermediate_size=max(8, real.moe_intermediate_size * args.hidden // 2048),
        num_hidden_layers=real.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads * real.num_key_value_heads // real.num_attention_heads),
        head_dim=real.head_dim if args.hidden == real.hidden_size else args.hidden // heads,
        num_experts=args.experts,
        num_experts_per_tok=min(real.num_experts_per_tok, args.experts),
        norm_topk_prob=real.norm_topk_prob,
        rms_norm_eps=real.rms_norm_eps,
        rope_theta=real.rope_theta,
        tie_word_embeddings=False,
    )
else:
    c = AutoConfig.from_pretrained(model)
c.num_hidden_layers = args.layers  # cut the number of layers for faster loading
if args.synthetic:
    m = AutoModel.from_config(c, dtype=torch.bfloat16)
else:
    m = AutoModel.from_pretrained(model, config=c)
if int(__import__("os").environ.get("RANK", "0")) == 0:
    print(f"model: {sum(1 for _ in m.parameters())} tensors")
dsc = dict(
    train_micro_batch_size_per_gpu=1,
    train_batch_size=world_size,
    zero_optimization=dict(stage=2),
    bf16=dict(enabled=True),
    optimizer=dict(type="AdamW"),
    gradient_accumulation_steps=1,
)
engine, *_ = deepspeed.initialize(model=m, config=dsc)
if engine.global_rank == 0:
    print(engine.init_report.summary())
torch.distributed.destroy_process_group()
