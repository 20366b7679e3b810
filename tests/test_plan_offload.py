"""``flatzero plan`` with optimizer offload: its host-bytes formula equals what an offloaded
``ZeroOptimizer`` allocates (world size 1, in this process), and the plan shows it."""

from __future__ import annotations

import pytest
import torch

from flatzero import FlattenConfig, OffloadConfig, ZeroOptimizer
from flatzero.bench.step import MODELS
from flatzero.cli import main
from flatzero.models import build_model
from flatzero.plan.model_source import ModelSource
from flatzero.plan.planner import PlanSpec, make_plan

BUCKET = 4096  # elements: several buckets


@pytest.mark.parametrize(("optimizer", "torch_optimizer", "kwargs"), [
    ("adamw", torch.optim.AdamW, {}),
    ("sgd", torch.optim.SGD, {"momentum": 0.9}),
])  # fmt: skip
def test_plan_offload_bytes_equal_what_the_optimizer_allocates(optimizer, torch_optimizer, kwargs):
    config = MODELS["tiny"]()
    model = build_model(config, device="cpu", dtype=torch.bfloat16, seed=0)
    opt = ZeroOptimizer(
        model,
        torch_optimizer,
        stage=2,
        flatten_config=FlattenConfig(bucket_numel=BUCKET, progress=False),
        offload_optimizer=OffloadConfig(threads=1),
        lr=1e-3,
        **kwargs,
    )
    try:
        ids = torch.randint(0, config.vocab_size, (1, 8))
        model(ids, labels=ids).loss.backward()
        opt.step()  # the optimizer state exists from the first step on
        plan = make_plan(
            PlanSpec(
                model=ModelSource("tiny", config),
                gpus_per_node=1,
                gpu=None,
                optimizer=optimizer,
                bucket_numel=BUCKET,
                offload_optimizer=True,
            )
        )
        assert plan.layout.groups[0].shard_numel == opt.flat.groups[0].layout.shard_numel
        assert plan.offload_host == opt.offload_host_bytes()
    finally:
        opt.close()


def test_plan_shows_offload_host_memory_only_when_asked(capsys):
    argv = ["plan", "--model", "llama-0.4b", "--gpus-per-node", "2", "--gpu", "none"]
    assert main(argv) == 0
    assert "optimizer offload" not in capsys.readouterr().out
    assert main([*argv, "--offload-optimizer", "cpu"]) == 0
    text = capsys.readouterr().out
    # 0.426B params over 2 ranks: 4 B master + 8 B AdamW state + 4 B gradient a shard element.
    assert "optimizer offload (offload_optimizer: cpu)" in text
    assert "peak per rank                    3.18" in text
