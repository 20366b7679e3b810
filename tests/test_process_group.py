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


def _timeouts(rank: int, world_size: int) -> dict[str, str]:
    """The timeouts of the groups a one-process ``flatzero.initialize`` makes itself."""
    import os

    import torch

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        os.environ.pop(name, None)
    dist.destroy_process_group()  # run_ranks' own group: initialize makes the job's
    flatzero.initialize(model=nn.Linear(3, 2), config=_CONFIG)
    world = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    return {"world": str(world)}


@pytest.mark.parametrize(("minutes", "expected"), [(None, "0:30:00"), ("3", "0:03:00")])
def test_deepspeed_timeout_sets_the_groups_flatzero_makes(minutes, expected):
    from flatzero.launch import run_ranks

    env = {} if minutes is None else {"DEEPSPEED_TIMEOUT": minutes}
    assert run_ranks(_timeouts, 1, env=env)[0]["world"] == expected


@pytest.mark.parametrize("value", ["0", "ten", "-5", "1.5"])
def test_a_bad_deepspeed_timeout_is_named(value, monkeypatch):
    from flatzero.process_group import job_timeout

    monkeypatch.setenv("DEEPSPEED_TIMEOUT", value)
    with pytest.raises(ValueError, match=f"DEEPSPEED_TIMEOUT='{value}'.*minutes"):
        job_timeout()
