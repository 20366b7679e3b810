"""Kill a 2-rank run again and again, resume until done (issue 24 item 5).

``kill_scripts/resumable_train.py`` trains a ZeRO-2 model through the DeepSpeed door at 2
ranks (gloo), saving under one tag every 2 steps and resuming from ``latest``. Attempts are
SIGKILLed, both ranks at once, at points drawn from a seed: inside a synchronous save and an
asynchronous one (while a rank file is half written, after it, after ``meta.json``, right
after the exchange that replaces the tag, before ``latest`` moves, after the snapshot of an
asynchronous save) and inside a step; each next attempt resumes from what the last left,
until one finishes. Every loss any attempt computed, recomputed steps included, and the
final optimizer state (masters, moments, step) must equal an uninterrupted run's bit for
bit.

The ranks are forks of the suite's preloaded rank server (``conftest.py``), each running the
script as ``__main__`` in a process group of its own making: real processes that the kill
ends, without 18 interpreter starts and torch imports (~35 CPU-seconds).
"""

from __future__ import annotations

import json
import os
import random
import runpy
import signal
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from flatzero.checkpoint import CheckpointReader
from flatzero.ports import free_port

SCRIPT = Path(__file__).parent / "kill_scripts" / "resumable_train.py"
STEPS, SAVE_EVERY = 24, 2
SEED = 24
SAVE_POINTS = ("tensor_written", "rank_file_written", "before_publish", "after_exchange")
ASYNC_POINTS = (*SAVE_POINTS, "snapshot_taken", "copying_snapshot")
PLAN = (("save", "sync"), ("save", "async"), ("step", "sync"), ("save", "async"))
PLAN += (("save", "sync"), ("step", "async"), ("save", "async"))
"""The kinds of kill, in order; points, counts, ranks drawn from ``SEED``."""


def draw(rng: random.Random, kind: str, mode: str) -> str:
    """``point:count:rank`` of one kill."""
    if kind == "step":
        return f"step:{rng.randint(1, 3)}:{rng.randint(0, 1)}"
    point = rng.choice(ASYNC_POINTS if mode == "async" else SAVE_POINTS)
    if point == "tensor_written":  # 3 tensors per rank file: master and two moments
        return f"{point}:{rng.randint(1, 6)}:{rng.randint(0, 1)}"
    per_rank = ("rank_file_written", "snapshot_taken", "copying_snapshot")
    rank = rng.randint(0, 1) if point in per_rank else 0
    return f"{point}:{rng.randint(1, 2)}:{rank}"


def _rank(argv: list[str], env: dict[str, str], leader: int, ready) -> None:
    """One rank, in a fork of the rank server: joins the process group of the OS that
    ``leader`` leads (0: leads a new one; ``ready`` is set once it exists), then runs the
    script as ``python SCRIPT argv...`` would, with ``env`` as its environment."""
    os.setpgid(0, leader)
    ready.set()
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [str(SCRIPT), *argv]
    runpy.run_path(str(SCRIPT), run_name="__main__")


def attempt(ckpt: Path, log: Path, kill: str, mode: str) -> list[int]:
    """Run both ranks to the end or the kill; their exit codes."""
    port = str(free_port())
    ctx = mp.get_context("forkserver")
    argv = [str(ckpt), str(log), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY)]
    procs: list = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
            "KILL_AT": kill,
            "ASYNC_SAVE": "1" if mode == "async" else "0",
            "SLOW_WRITES": "0.02",  # asynchronous writes outlast the next steps
        }
        group = procs[0].pid if procs else 0  # one group of the OS for both ranks
        ready = ctx.Event()
        procs.append(ctx.Process(target=_rank, args=(argv, env, group, ready)))
        procs[-1].start()
        assert ready.wait(60), "the rank did not start"
    try:
        for p in procs:
            p.join(timeout=120)
        return [p.exitcode for p in procs]
    finally:
        if any(p.exitcode is None for p in procs):
            os.killpg(procs[0].pid, signal.SIGKILL)
            for p in procs:
                p.join()


def saved_step(ckpt: Path) -> int:
    """The engine's ``global_steps`` in the checkpoint ``latest`` names (0: none)."""
    if not (ckpt / "latest").exists():
        return 0
    with CheckpointReader(ckpt) as reader:
        return reader.meta.extra["flatzero_engine"]["global_steps"]


def losses(log: Path, rank: int) -> list[tuple[int, str]]:
    lines = (log / f"losses.rank{rank}.jsonl").read_text().splitlines()
    return [(d["step"], d["loss"]) for d in map(json.loads, lines)]


@pytest.mark.slow
def test_killed_again_and_again_resumes_bitwise(tmp_path):
    reference = tmp_path / "reference"
    reference.mkdir()
    assert attempt(reference / "ckpt", reference, "", "sync") == [0, 0]

    run = tmp_path / "killed"
    run.mkdir()
    ckpt = run / "ckpt"
    rng = random.Random(SEED)
    history = []
    for kind, mode in PLAN:
        kill = draw(rng, kind, mode)
        before = saved_step(ckpt)
        codes = attempt(ckpt, run, kill, mode)
        history.append((kill, mode, before, codes))
        assert codes == [-signal.SIGKILL] * 2, history  # every drawn kill happened
        assert saved_step(ckpt) >= before, history  # a kill never loses a published save
    assert attempt(ckpt, run, "", "async") == [0, 0], history  # resume until done

    for rank in range(2):
        expected = dict(losses(reference, rank))
        assert sorted(expected) == list(range(STEPS))
        computed = losses(run, rank)
        assert {s for s, _ in computed} == set(expected)
        recomputed = len(computed) - STEPS
        assert recomputed > 0, "no step was computed twice: the kills hit nothing"
        for step, loss in computed:
            assert loss == expected[step], (rank, step)
        final = torch.load(run / f"final.rank{rank}.pt")
        want = torch.load(reference / f"final.rank{rank}.pt")
        assert final.keys() == want.keys()
        for key in want:
            assert torch.equal(final[key], want[key]), (rank, key)
