"""``flatzero plan`` with asynchronous saves: its host-snapshot formula equals the bytes the
asynchronous saver allocates (world size 1, in this process), and the plan shows it."""

from __future__ import annotations

import torch

from flatzero.checkpoint import SaveConfig, save_checkpoint
from flatzero.checkpoint.checkpointer import checkpointer_of, release_snapshot, wait_for_save
from flatzero.checkpoint.collect import layout_names
from flatzero.checkpoint.writer import model_extras
from flatzero.cli import main
from flatzero.plan.memory_model import async_snapshot_bytes
from plan_fixtures import OPTIMIZERS, stepped_tiny, tiny_plan


@OPTIMIZERS
def test_plan_async_snapshot_equals_what_the_saver_allocates(
    tmp_path, optimizer, torch_optimizer, kwargs
):
    config, model, opt = stepped_tiny(torch_optimizer, kwargs)
    try:
        plan = tiny_plan(config, optimizer, async_save=True)
        assert plan.layout.groups[0].shard_numel == opt.flat.groups[0].layout.shard_numel
        save_checkpoint(tmp_path, opt, tag="a", asynchronous=True)
        wait_for_save(opt)
        assert checkpointer_of(opt).snapshot.data.numel() == plan.async_snapshot

        # with RNG states and the model's frozen params and buffers (rank 0)
        model.register_buffer("stats", torch.arange(1001, dtype=torch.float32))  # persistent
        rest = model_extras(model, layout_names(opt.flat))[0]
        assert "stats" in rest
        rest_bytes = sum(t.numel() * t.element_size() for t in rest.values())
        release_snapshot(opt)
        config_rng = SaveConfig(save_rng=True)
        save_checkpoint(tmp_path, opt, tag="b", model=model, config=config_rng, asynchronous=True)
        wait_for_save(opt)
        rng_bytes = torch.get_rng_state().numel()
        assert checkpointer_of(opt).snapshot.data.numel() == async_snapshot_bytes(
            opt.flat.layout, optimizer=optimizer, rank_file_extra=rng_bytes, rest_bytes=rest_bytes
        )
    finally:
        opt.close()


def test_plan_shows_the_async_snapshot(capsys):
    argv = ["plan", "--model", "llama-0.4b", "--gpus-per-node", "2", "--gpu", "none"]
    assert main(argv) == 0
    # 0.426B params over 2 ranks: 4 B master + 8 B AdamW state a shard element
    assert "(async save, not configured, would keep 2.38 GiB" in capsys.readouterr().out
    assert main([*argv, "--async-save"]) == 0
    shown = capsys.readouterr().out
    assert "  async save snapshot (host)       2.38   (fp32 master + adamw" in shown
