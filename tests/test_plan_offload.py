"""``flatzero plan`` with optimizer offload: its host-bytes formula equals what an offloaded
``ZeroOptimizer`` allocates (world size 1, in this process), and the plan shows it."""

from __future__ import annotations

from flatzero import OffloadConfig
from flatzero.cli import main
from plan_fixtures import OPTIMIZERS, stepped_tiny, tiny_plan


@OPTIMIZERS
def test_plan_offload_bytes_equal_what_the_optimizer_allocates(optimizer, torch_optimizer, kwargs):
    config, _, opt = stepped_tiny(
        torch_optimizer, kwargs, offload_optimizer=OffloadConfig(threads=1)
    )
    try:
        plan = tiny_plan(config, optimizer, offload_optimizer=True)
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


def test_plan_adds_autograd_largest_gradient_in_backward(capsys):
    """The backward moment ``flatzero plan`` adds is the largest gradient autograd makes for
    the model (in the params' dtype), as a plain backward pass shows."""
    import torch

    from flatzero.models import build_model
    from flatzero.models.bench_models import STEP_MODELS as MODELS

    config = MODELS["tiny"]()
    model = build_model(config, device="cpu", dtype=torch.bfloat16, seed=0)
    ids = torch.randint(0, config.vocab_size, (1, 8))
    model(ids, labels=ids).loss.backward()
    largest = max(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    assert tiny_plan(config, "adamw").largest_gradient == largest
    assert main(["plan", "--model", "llama-0.4b", "--gpu", "none"]) == 0
    assert "+ in backward, a moment          0.24" in capsys.readouterr().out  # lm_head
