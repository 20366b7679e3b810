"""A rank that stops responding, or dies, in the middle of a save (issue 40 item 6).

Real faults: the rank sends itself SIGSTOP (or SIGKILL) after writing its first tensor,
so it never reaches the wait for the others' writing. The job's timeout comes from
``FLATZERO_TIMEOUT`` (seconds), shortened to a few seconds: every other rank must get an
error naming the stopped rank within that timeout plus slack, and an error at once (as
DeepSpeed's survivors do) when it died. ``run_ranks`` SIGKILLs the stopped rank once the
others have failed.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time

import pytest
import torch
from torch import nn

from flatzero import FlattenConfig
from flatzero.launch import run_ranks

_TIMEOUT_S = 3.0
"""``FLATZERO_TIMEOUT`` of these tests (seconds)."""


def _optimizer() -> torch.optim.Optimizer:
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
    model(torch.randn(6, 8)).square().mean().backward()
    opt.step()
    return opt


def _save_while_rank1_gets(rank: int, ws: int, root: str, sig: int, asynchronous: bool) -> None:
    """Every rank saves; rank 1 sends itself ``sig`` after its first tensor. The others
    raise their error with the seconds it took in front."""
    from flatzero.checkpoint import save_checkpoint
    from flatzero.checkpoint.atomic import set_fault_hook
    from flatzero.checkpoint.checkpointer import wait_for_save

    opt = _optimizer()
    pid_file = os.path.join(root, "rank1.pid")
    if rank == 1:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        set_fault_hook(
            lambda point, r: os.kill(os.getpid(), sig) if point == "tensor_written" else None
        )
    t0 = time.monotonic()
    try:
        save_checkpoint(root, opt, "t", asynchronous=asynchronous)
        wait_for_save(opt)
    except Exception as error:
        seconds = time.monotonic() - t0
        if rank == 0:  # a stopped rank 1 is killed now, not after run_ranks' grace time
            with open(pid_file) as f, contextlib.suppress(ProcessLookupError):
                os.kill(int(f.read()), signal.SIGKILL)
            # run_ranks' store lives in rank 0 (torchrun's in its agent): it stays up until
            # rank 2 has read rank 0's verdict from it.
            time.sleep(2)
        raise RuntimeError(f"AFTER {seconds:.2f} S: {error}") from error


def _errors(
    root: str, sig: int, world_size: int, env: dict[str, str], asynchronous: bool = False
) -> dict[int, tuple[float, str]]:
    """Each surviving rank's (seconds to its error, its message)."""
    with pytest.raises(RuntimeError) as raised:
        run_ranks(
            _save_while_rank1_gets, world_size, root, sig, asynchronous, env=env, timeout_s=60
        )
    found = re.findall(
        r"rank (\d+) failed:\n(?:(?!rank \d+ failed).)*?RuntimeError: AFTER ([\d.]+) S: (.*?)\n",
        str(raised.value),
        re.S,
    )
    return {int(r): (float(t), text) for r, t, text in found}


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_stopped_rank_is_named_on_every_other_rank_within_the_timeout(tmp_path, asynchronous):
    world_size = 3  # rank 0 names it, and rank 2 learns it from rank 0
    env = {"FLATZERO_TIMEOUT": str(_TIMEOUT_S)}
    errors = _errors(str(tmp_path), signal.SIGSTOP, world_size, env, asynchronous)
    assert sorted(errors) == [0, 2], errors
    for seconds, text in errors.values():
        assert "rank 1 did not reach" in text and "stopped, hung or dead" in text, text
        assert "FLATZERO_TIMEOUT" in text, text
        assert _TIMEOUT_S * 0.9 <= seconds < _TIMEOUT_S + 5, (seconds, text)
    assert not (tmp_path / "t").exists()


def test_a_dead_rank_fails_the_others_at_once(tmp_path):
    # Asynchronous: rank 0's thread would wait for the dead rank's report until the
    # timeout; the ranks' meeting in wait_for_save notices the death at once. (A
    # synchronous save meets the same way, in wait_for_host_work.)
    asynchronous = True
    errors = _errors(str(tmp_path), signal.SIGKILL, 3, {}, asynchronous)  # timeout: 30 min
    assert sorted(errors) == [0, 2], errors
    for seconds, text in errors.values():
        assert "rank 1" in text, text
        assert seconds < 10, (seconds, text)  # DeepSpeed's survivors: 0.05 s
