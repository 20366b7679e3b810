"""A ZeRO-2 training script launched by ``torchrun``, on one host or several.

Used by ``tests/test_two_hosts.py``. Every rank writes ``OUT/rank<RANK>.json`` with what
it saw (global and local rank, its host, flatzero's core share from the init report, the
losses);
rank 0 writes the final weights (fp32 masters, gathered) to ``OUT/weights.safetensors``.

``--mode train``: ``flatzero.initialize`` a tiny Llama whose sizes do not divide by the
world size, train 5 steps on data that depends only on (step, global rank), check the
control group across hosts, and save a checkpoint with every rank into ``--ckpt``.

``--mode reload``: ``flatzero.initialize`` the same model from another seed, load
``--ckpt`` (saved at any world size) and write the weights it loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import flatzero
from flatzero.control import raise_if_any_failed, wait_for_host_work
from flatzero.cores import usable_cores
from flatzero.models import LlamaConfig, LlamaForCausalLM, materialize
from flatzero.own_groups import control_group

STEPS = 5
MICRO = 2
SEQ = 7
BUCKET = 500
"""Elements per bucket: several buckets, and the embedding (1,818 elements) in one of its
own, larger than a bucket."""

ODD_LLAMA = LlamaConfig(
    vocab_size=101,
    hidden_size=18,
    intermediate_size=35,
    num_hidden_layers=2,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=6,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
"""Sizes that do not divide by 4 (or 2): embedding 101 x 18, norms of 18, MLP 35 x 18."""


def make_model(seed: int) -> LlamaForCausalLM:
    """``build_model(ODD_LLAMA, device="cpu", dtype=torch.float32, seed=seed)``, the same
    values, without its construction on the meta device (whose first ``normal_`` costs
    each process a second or more of lazy imports in torch)."""
    with torch.device("cpu"):
        model = LlamaForCausalLM(ODD_LLAMA)
    return materialize(model, "cpu", seed=seed)


def ds_config(world_size: int) -> dict:
    return {
        "train_batch_size": MICRO * world_size,
        "train_micro_batch_size_per_gpu": MICRO,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": BUCKET},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95]}},
        "gradient_clipping": 1.0,
        "flatzero": {"progress": False},
    }


def batch_of(step: int, rank: int) -> torch.Tensor:
    """Token ids of (step, global rank): the same wherever that rank runs."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, ODD_LLAMA.vocab_size, (MICRO, SEQ), generator=g)


def whoami() -> dict:
    env = os.environ
    record = {
        "host": env.get("FLATZERO_TEST_HOST", "local"),
        "rank": int(env["RANK"]),
        "local_rank": int(env["LOCAL_RANK"]),
        "group_rank": int(env["GROUP_RANK"]),
        "world_size": int(env["WORLD_SIZE"]),
        "local_world_size_env": int(env["LOCAL_WORLD_SIZE"]),
        "master_addr": env["MASTER_ADDR"],
        "gloo_ifname": env.get("GLOO_SOCKET_IFNAME"),
        "usable_cores": usable_cores(),
    }
    # torchrun numbers ranks node by node: global = node * ranks per node + local.
    node_base = record["group_rank"] * record["local_world_size_env"]
    assert record["rank"] == node_base + record["local_rank"], record
    if record["group_rank"] > 0:
        assert record["local_rank"] != record["rank"], record
    return record


def check_control_group(record: dict) -> None:
    """Host-side agreement across the hosts: the star of point-to-point messages through
    rank 0 and the error agreement (a failure on the last rank reaches every rank)."""
    group = control_group(None)
    wait_for_host_work(None, 1 << 20)
    last = dist.get_world_size() - 1
    mine = RuntimeError("planted on the last rank") if dist.get_rank() == last else None
    try:
        raise_if_any_failed(mine, None, "failed on another rank")
    except RuntimeError as e:
        record["agreed_error"] = str(e)
    record["control_is_world"] = group is None or group is dist.group.WORLD


def train(args: argparse.Namespace, record: dict) -> None:
    model = make_model(seed=0)
    engine, opt, _, _ = flatzero.initialize(model=model, config=ds_config(record["world_size"]))
    record["tiers"] = list(opt.flat.report.tiers)
    record["core_share"] = dataclasses.asdict(opt.flat.report.core_share)
    record["init_threads"] = opt.flat.report.host_threads
    check_control_group(record)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    losses, mean_losses = [], []
    for step in range(STEPS):
        batch = batch_of(step, rank)
        loss = engine(batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        total = loss.detach().clone()
        dist.all_reduce(total)
        mean_losses.append((total / world_size).item())
    record["losses"] = losses
    record["mean_losses"] = mean_losses
    engine.save_checkpoint(args.ckpt, tag="final")
    write_weights(args, opt.full_params(), record)
    engine.destroy()


def reload(args: argparse.Namespace, record: dict) -> None:
    model = make_model(seed=1)
    engine, opt, _, _ = flatzero.initialize(model=model, config=ds_config(record["world_size"]))
    path, _ = engine.load_checkpoint(args.ckpt)
    record["loaded"] = str(path)
    record["global_steps"] = engine.global_steps
    write_weights(args, opt.full_params(), record)
    engine.destroy()


def write_weights(args: argparse.Namespace, full: dict, record: dict) -> None:
    if record["rank"] == 0:
        save_file(full, str(Path(args.out) / "weights.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("train", "reload"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    record = whoami()
    (train if args.mode == "train" else reload)(args, record)
    path = Path(args.out) / f"rank{record['rank']}.json"
    path.write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
