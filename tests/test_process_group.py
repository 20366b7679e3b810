"""The process group of ``flatzero.initialize``: never a silent world of one under a
launcher that started several processes."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch import nn

import flatzero

_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2},
}


@pytest.mark.parametrize("launcher", ["SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
def test_srun_without_torchrun_env_is_an_error_not_a_world_of_one(launcher, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(launcher, "8")
    model = nn.Linear(3, 2)
    weight = model.weight.detach().clone()
    with pytest.raises(ValueError, match=f"{launcher}=8 .*RANK, WORLD_SIZE, MASTER_ADDR"):
        flatzero.initialize(model=model, config=_CONFIG)
    assert not dist.is_initialized()
    assert model.weight.equal(weight)
