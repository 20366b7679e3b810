"""A rank's own device error inside a step's collective is not a peer's silence (review2).

Rank 0 runs out of memory launching a gradient reduction (the error injected where the
collective is called; 2 gloo ranks). It must raise its ``torch.OutOfMemoryError`` itself,
at once, not a ``StepCollectiveFailed`` naming healthy rank 1 as "did not respond" after
waiting out the roll call; rank 1 still learns rank 0's error from the roll call.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flatzero import FlattenConfig
from flatzero.launch import run_ranks


def _oom_on_rank_0(rank: int, ws: int) -> None:
    from flatzero.optim import ZeroOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    opt = ZeroOptimizer(
        list(model.parameters()),
        torch.optim.AdamW,
        stage=2,
        flatten_config=FlattenConfig(bucket_numel=200, progress=False),
        lr=1e-2,
    )
    model(torch.randn(6, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    if rank == 0:

        def oom(*args: object, **kwargs: object) -> None:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        dist.reduce = oom
    t0 = time.monotonic()
    try:
        model(torch.randn(6, 8)).sum().backward()
        opt.step()
    except Exception as error:
        seconds = time.monotonic() - t0
        if rank == 0:
            time.sleep(3.0)  # the store lives in rank 0: rank 1 times out (1 s), reads it
        raise RuntimeError(f"AFTER {seconds:.2f} S {type(error).__name__}: {error}") from error


def test_an_out_of_memory_error_in_a_collective_is_raised_unchanged_at_once(tmp_path):
    with pytest.raises(RuntimeError) as raised:
        run_ranks(_oom_on_rank_0, 2, env={"FLATZERO_TIMEOUT": "1"}, timeout_s=30)
    found = dict(
        re.findall(r"rank (\d) failed:.*?RuntimeError: AFTER ([^\n]*)", str(raised.value), re.S)
    )
    seconds, text = found["0"].split(" S ", 1)
    assert text.startswith("OutOfMemoryError: CUDA out of memory"), text
    assert float(seconds) < 1.0, found["0"]  # not the roll call's wait
    assert "StepCollectiveFailed" in found["1"] and "rank 0: CUDA out of memory" in found["1"]


def test_a_proc_of_another_pid_namespace_is_no_machine_to_look_at():
    # unshare --pid without --mount-proc: os.getpid() is 1, /proc/1 is the host's init; the
    # roll call must not judge a peer's pid by it (it would call a dead rank "running").
    probe = "from flatzero.roll_call import _machine; print(repr(_machine()))"
    own = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert own.stdout.strip() not in ("", "''"), own.stderr
    try:
        inside = subprocess.run(
            ["unshare", "--pid", "--fork", sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except FileNotFoundError:
        pytest.skip("no unshare")
    if inside.returncode != 0 and "Operation not permitted" in inside.stderr:
        pytest.skip("unshare --pid not permitted here")
    assert inside.stdout.strip() == "''", inside.stderr


def _fail_twice(rank: int, ws: int, root: str) -> str:
    """Two trainings in one process, the process group made anew between them (an
    in-process restart): in the first rank 1 is late, in the second rank 0. What rank 1's
    second error says."""
    from flatzero.optim import ZeroOptimizer

    def train(late: int) -> str:
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
        opt = ZeroOptimizer(
            list(model.parameters()),
            torch.optim.SGD,
            stage=1,
            flatten_config=FlattenConfig(bucket_numel=200, progress=False),
            lr=1e-2,
        )
        if rank == late:  # past the 1 s timeout (and, the second time, the others' roll call)
            time.sleep(1.2 if late == 1 else 2.5)
        try:
            model(torch.randn(6, 8)).sum().backward()
            opt.step()
        except RuntimeError as error:
            return str(error)
        return ""

    train(late=1)
    time.sleep(2.0)  # both ranks done with the first failure
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{root}/again", rank=rank, world_size=ws)
    return train(late=0)


def test_a_process_group_made_anew_gets_its_own_roll_call(tmp_path):
    second = run_ranks(_fail_twice, 2, str(tmp_path), env={"FLATZERO_TIMEOUT": "1"}, timeout_s=30)
    assert "failed before" not in second[1], second[1]
    assert "rank 0 did not respond" in second[1], second[1]
