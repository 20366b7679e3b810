"""The process group of ``flatzero.initialize``: never a silent world of one under a
launcher that started several processes."""

from __future__ import annotations

import os

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


@pytest.mark.parametrize(
    ("seconds", "minutes", "expected"),
    [("2.5", None, 2.5), ("7", "3", 7.0), (None, "3", 180.0), ("", None, 1800.0)],
)
def test_flatzero_timeout_takes_precedence_over_deepspeed_timeout(
    seconds, minutes, expected, monkeypatch
):
    from flatzero.control import host_work_timeout
    from flatzero.process_group import job_timeout

    for name, value in (("FLATZERO_TIMEOUT", seconds), ("DEEPSPEED_TIMEOUT", minutes)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert job_timeout().total_seconds() == expected
    assert host_work_timeout(0).total_seconds() == expected  # flatzero's own waits
    assert host_work_timeout(10**12).total_seconds() == 50_000  # 1 TB at 20 MB/s


@pytest.mark.parametrize("value", ["0", "ten", "-5", "nan", "inf"])
def test_a_bad_flatzero_timeout_is_named(value, monkeypatch):
    from flatzero.process_group import job_timeout

    monkeypatch.setenv("FLATZERO_TIMEOUT", value)
    with pytest.raises(ValueError, match=f"FLATZERO_TIMEOUT='{value}'.*seconds"):
        job_timeout()


def test_a_port_taken_before_the_store_listens_is_replaced_only_when_flatzero_chose_it(
    monkeypatch,
):
    """``free_port`` probes a port and lets it go; another process may take it before
    c10d's store listens (EADDRINUSE, seen under a loaded suite). A one-process group
    whose port flatzero chose tries a fresh one; a port the user set is never replaced."""
    import torch.distributed as dist

    from flatzero import process_group

    tried = []

    def init(backend, timeout):
        tried.append(os.environ["MASTER_PORT"])
        if len(tried) == 1:
            raise dist.DistNetworkError("failed to listen ... EADDRINUSE, address already in use")

    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.setattr(process_group, "free_port", iter([41001, 41002, 41003]).__next__)
    monkeypatch.setenv("MASTER_PORT", "41000")
    process_group._init_default_group("gloo", port_chosen=True)
    assert tried == ["41000", "41001"]
    tried.clear()
    with pytest.raises(dist.DistNetworkError, match="EADDRINUSE"):
        process_group._init_default_group("gloo", port_chosen=False)
    assert tried == ["41001"]
