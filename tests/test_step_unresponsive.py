"""A rank that stops responding, or dies, in the middle of a training step (issue 40 item 6).

Real faults, 3 ranks over gloo: at the fourth step rank 1 (or 0) sends itself SIGSTOP (or SIGKILL)
while the others go on into the step's collectives. gloo alone says "Timed out waiting
3000ms for send operation to complete" or "Connection reset by peer", naming no rank; every
other rank must raise an error naming rank 1 and what the ranks were doing, within the
job's timeout (``FLATZERO_TIMEOUT``, shortened to a few seconds) plus slack, and at once
when rank 1 died. Rank 0 (1) SIGKILLs a stopped rank 1 (0) once it has its error. Under real
``torchrun``, a job one of whose ranks is killed mid-training ends, non-zero, promptly.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flatzero import FlattenConfig
from flatzero.launch import run_ranks
from gloo_abort import GLOO_ABORT, GLOO_ABORT_RETRIES

_TIMEOUT_S = 3.0
"""``FLATZERO_TIMEOUT`` of these tests (seconds)."""

_MICRO = 6

Step = Callable[[Callable[[], None] | None], None]
"""One training step; the callback runs after backward and its reductions, before the
optimizer's step."""


def _trainer(stage: int, door: str, world_size: int) -> Step:
    """A one-micro-batch step of a small model through ``door``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    if door == "deepspeed":
        import flatzero

        config = {
            "train_batch_size": _MICRO * world_size,
            "train_micro_batch_size_per_gpu": _MICRO,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 200},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "flatzero": {"progress": False},
        }
        engine, opt, *_ = flatzero.initialize(model=model, config=config)
        forward_backward = lambda: engine.backward(engine(torch.randn(_MICRO, 8)).sum())  # noqa: E731
        optimizer_step = engine.step
    else:
        from flatzero.optim import ZeroOptimizer

        opt = ZeroOptimizer(
            list(model.parameters()),
            torch.optim.AdamW,
            stage=stage,
            flatten_config=FlattenConfig(bucket_numel=200, progress=False),
            lr=1e-2,
        )
        forward_backward = lambda: model(torch.randn(_MICRO, 8)).sum().backward()  # noqa: E731
        optimizer_step = opt.step

    def step(before_step: Callable[[], None] | None) -> None:
        forward_backward()
        if before_step is not None:
            opt.reduce_gradients()
            before_step()
        optimizer_step()

    return step


def _train_while_one_gets(
    rank: int,
    ws: int,
    root: str,
    sig: int,
    stage: int,
    door: str,
    point: str,
    elsewhere: bool,
    victim: int,
) -> None:
    """Every rank trains; at the fourth step rank ``victim`` sends itself ``sig`` at ``point``
    ("backward": before its backward pass; "step": after its reductions, before its step).
    The others raise their error with the seconds it took in front."""
    store = dist.distributed_c10d._get_default_store()
    step = _trainer(stage, door, ws)
    step(None)
    keys = store.num_keys()
    step(None)
    assert store.num_keys() == keys, "a step wrote to the store"  # nothing on the happy path
    step(None)  # no rank stops before every rank is done with the store (rank 0 hosts it)
    pid_file = os.path.join(root, "victim.pid")
    fault = None
    if rank == victim:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
        if elsewhere:  # as if rank 1 ran on another machine: its record says so
            from flatzero.roll_call import _process_key

            record = json.loads(store.get(_process_key(victim)))
            store.set(_process_key(victim), json.dumps({**record, "machine": "?", "host": "node7"}))
        fault = lambda: os.kill(os.getpid(), sig)  # noqa: E731
        if point == "backward":
            fault()
    t0 = time.monotonic()
    try:
        step(fault if point == "step" else None)
        step(None)  # an overlapped gather (DeepSpeed door) is waited for in this forward
    except Exception as error:
        seconds = time.monotonic() - t0
        if rank == min({0, 1} - {victim}):  # a stopped victim is killed now, not after
            with open(pid_file) as f, contextlib.suppress(ProcessLookupError):  # run_ranks' grace
                os.kill(int(f.read()), signal.SIGKILL)
            time.sleep(1.5)  # the store lives in rank 0: rank 2 may still read it
        raise RuntimeError(f"AFTER {seconds:.2f} S: {error}") from error


def _errors(
    root: str, sig: int, stage: int, door: str, point: str, elsewhere: bool = False, victim=1
) -> dict[int, tuple[float, str]]:
    """Each surviving rank's (seconds to its error, its message)."""
    with pytest.raises(RuntimeError) as raised:
        run_ranks(
            _train_while_one_gets,
            3,
            root,
            sig,
            stage,
            door,
            point,
            elsewhere,
            victim,
            env={"FLATZERO_TIMEOUT": str(_TIMEOUT_S)},
            timeout_s=60,
        )
    found = re.findall(
        r"rank (\d+) failed:\n(?:(?!rank \d+ failed).)*?RuntimeError: AFTER ([\d.]+) S: (.*?)\n",
        str(raised.value),
        re.S,
    )
    return {int(r): (float(t), text) for r, t, text in found}


def test_a_rank_stopped_in_a_step_is_named_on_every_other_rank_within_the_timeout(tmp_path):
    # The PyTorch door at stage 1: rank 1 stops before its backward pass; the others time
    # out in the step's reductions. This machine sees rank 1's process stopped.
    errors = _errors(str(tmp_path), signal.SIGSTOP, 1, "torch", "backward")
    assert sorted(errors) == [0, 2], errors
    for seconds, text in errors.values():
        assert "rank 1 did not respond within 3 s: its process (pid " in text, text
        assert "is stopped (SIGSTOP" in text, text
        assert "while waiting for the gradient reductions" in text, text
        assert "after 3 optimizer steps" in text and "ranks 0, 2" in text, text
        assert "FLATZERO_TIMEOUT" in text, text
        assert _TIMEOUT_S * 0.9 <= seconds < _TIMEOUT_S + 5, (seconds, text)


def test_a_rank_stopped_on_another_machine_is_named_after_the_roll_call(tmp_path):
    # The DeepSpeed door at stage 2: rank 1 stops after its reductions, before its step;
    # the others time out in the norm's all-reduce. Nothing on this machine knows rank 1's
    # process (as on another machine): the others wait for its post in the store for the
    # roll call's timeout (min(FLATZERO_TIMEOUT, 5 s)) before naming it.
    errors = _errors(str(tmp_path), signal.SIGSTOP, 2, "deepspeed", "step", elsewhere=True)
    assert sorted(errors) == [0, 2], errors
    for seconds, text in errors.values():
        assert "rank 1 did not respond within 3 s (stopped, hung or dead on node7?)" in text, text
        assert "while all-reducing the gradient norm at the step" in text, text
        assert _TIMEOUT_S * 1.8 <= seconds < 2 * _TIMEOUT_S + 5, (seconds, text)


def test_a_stopped_store_host_bounds_the_roll_call(tmp_path):
    # run_ranks' store lives in rank 0 (torchrun's in its agent): with rank 0 stopped, even
    # a connection to the store blocks; the roll call is given up 2 s after its timeout.
    errors = _errors(str(tmp_path), signal.SIGSTOP, 2, "torch", "backward", victim=0)
    assert sorted(errors) == [1, 2], errors
    for seconds, text in errors.values():
        assert "the c10d store did not answer" in text and "rank 0" in text, text
        assert _TIMEOUT_S * 0.9 <= seconds < 2 * _TIMEOUT_S + 2 + 5, (seconds, text)


def test_a_rank_killed_in_a_step_is_named_at_once(tmp_path):
    # The PyTorch door at stage 2: rank 1 is killed before its backward pass; gloo's
    # connections to it reset at once, and this machine sees its process gone.
    errors = _errors(str(tmp_path), signal.SIGKILL, 2, "torch", "backward")
    assert sorted(errors) == [0, 2], errors
    for seconds, text in errors.values():
        assert "rank 1 is dead: its process (pid " in text, text
        assert seconds < _TIMEOUT_S, (seconds, text)  # no timeout waited for


_SCRIPT = Path(__file__).resolve().parent / "launcher_scripts" / "train_until_killed.py"
_SRC = Path(__file__).resolve().parents[1] / "src"
_JOB_END_S = 20.0
"""The most seconds torchrun may take to exit after a rank's kill (measured: see
docs/checkpoints.md; DeepSpeed's launcher: ~1.3 s)."""


def _torchrun_training(out: Path, log: Path) -> tuple[subprocess.Popen, list[int]]:
    """torchrun with 3 ranks of ``_SCRIPT``, once every rank trains: (torchrun, the ranks'
    pids). Launches again after gloo's connect-time abort (``gloo_abort.py``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_", "LOCAL_"))}
    env.update(PYTHONPATH=str(_SRC), FLATZERO_TIMEOUT=str(_TIMEOUT_S), OMP_NUM_THREADS="1")
    agent = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts=0"]
    cmd = [*agent, "--nproc-per-node=3", str(_SCRIPT), "--out", str(out), "--seconds", "120"]
    for _ in range(GLOO_ABORT_RETRIES + 1):
        for pid_file in out.glob("rank*.pid"):
            pid_file.unlink()
        with log.open("w") as f:
            proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            pids = sorted(out.glob("rank*.pid"))
            if len(pids) == 3:
                return proc, [int(p.read_text()) for p in pids]
            time.sleep(0.05)
        proc.kill()
        proc.wait()
        if GLOO_ABORT not in log.read_text():
            break
    raise AssertionError(f"the ranks did not start training: {log.read_text()[-3000:]}")


def test_torchrun_ends_promptly_after_a_rank_is_killed_mid_training(tmp_path):
    log = tmp_path / "torchrun.log"
    proc, pids = _torchrun_training(tmp_path, log)
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    try:
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    seconds = time.monotonic() - t0
    text = log.read_text()
    assert code != 0, text[-3000:]
    assert seconds < _JOB_END_S, (seconds, text[-3000:])
