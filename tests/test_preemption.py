"""Save on a signal under real torchrun, 2 ranks, gloo (issue 40 item 5).

``preemption_scripts/train.py`` trains through the DeepSpeed door with ``preemption_dir``
and asynchronous saves every 3 steps. Two launches of ``torchrun --nproc-per-node 2``:

1. SIGTERM to torchrun only (Kubernetes: the container's first process gets it; torchrun
   forwards it to the workers): every rank saves the same step, ``latest`` names it, the
   checkpoint is complete (every rank file verifies), the workers exit with 143.
2. Resumes from that step (every rank says so); then Slurm's way (``--signal=TERM@...``
   reaches every process of the step): SIGTERM to torchrun and to each worker, and once more
   to each worker; the workers get it three times: the same, at a later step, and no
   ``.tmp-*`` is left of the asynchronous saves.

Then the PyTorch door (``save_on_signal``, 2 ranks through ``run_ranks``) and the Hugging
Face route (an Accelerate loop through ``patch_deepspeed()``, one process), each with real
signals a process sends itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flatzero.checkpoint import CheckpointReader, load_checkpoint, read_latest, save_checkpoint

SCRIPT = Path(__file__).parent / "preemption_scripts" / "train.py"
TIMEOUT_S = 120


def torchrun(ckpt: Path, log: Path, steps: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(SCRIPT), str(ckpt), str(log), "--steps", str(steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_for_step(log: Path, at_least: int, proc: subprocess.Popen) -> None:
    """Until both ranks took ``at_least`` steps (in this launch's log)."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        steps = [log / f"step.rank{r}" for r in range(2)]
        if all(p.exists() and p.read_text() and int(p.read_text()) >= at_least for p in steps):
            return
        assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
        time.sleep(0.05)
    raise AssertionError("the ranks did not reach the step")


def preempted(log: Path) -> list[list[str]]:
    return [(log / f"preempted.rank{r}").read_text().split() for r in range(2)]


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err.decode()


def saved_step(ckpt: Path) -> int:
    """The engine step of the checkpoint ``latest`` names, after verifying every file."""
    with CheckpointReader(ckpt) as reader:
        reader.verify()
        return reader.meta.extra["flatzero_engine"]["global_steps"]


@pytest.mark.skipif(sys.platform != "linux", reason="signals as on a Linux cluster")
def test_sigterm_saves_the_same_step_on_every_rank_and_the_run_resumes(tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    logs = [tmp_path / f"launch{i}" for i in range(2)]
    for log in logs:
        log.mkdir()

    # 1. Kubernetes: SIGTERM to torchrun only
    proc = torchrun(ckpt, logs[0], 1000)
    wait_for_step(logs[0], 4, proc)
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc)
    assert code != 0, err[-3000:]
    first = preempted(logs[0])
    assert first[0] == first[1], first  # the same step on every rank
    step, tag, status = first[0]
    assert tag == f"global_step{step}" and status == "143", first
    assert read_latest(ckpt) == tag and saved_step(ckpt) == int(step)

    # 2. Slurm: SIGTERM to torchrun and to the workers, then to the workers again
    proc = torchrun(ckpt, logs[1], 1000)
    wait_for_step(logs[1], int(step) + 3, proc)
    pids = [int((logs[1] / f"pid.rank{r}").read_text()) for r in range(2)]
    for target in [proc.pid, *pids, *pids]:
        os.kill(target, signal.SIGTERM)
        time.sleep(0.02)
    code, err = finish(proc)
    assert code != 0, err[-3000:]
    assert [(logs[1] / f"resumed.rank{r}").read_text().split() for r in range(2)] == [[step]] * 2
    second = preempted(logs[1])
    assert second[0] == second[1] and int(second[0][0]) > int(step), (first, second)
    step2, tag2, _ = second[0]
    assert read_latest(ckpt) == tag2 and saved_step(ckpt) == int(step2)
    assert not list(ckpt.glob(".tmp-*"))


def pytorch_door_preempted(rank: int, ws: int, root: str) -> dict:
    """``save_on_signal`` at 2 ranks; rank 1 gets SIGTERM twice after its 3rd step (real
    signals, sent to itself) while an asynchronous save is being written; what each saw."""
    import torch

    from flatzero.checkpoint import Preempted, PreemptionConfig, save_on_signal
    from flatzero.checkpoint.atomic import set_fault_hook
    from test_checkpoint_async import make, slow_writes, state, step

    model, opt = make()
    watch = save_on_signal(opt, PreemptionConfig(directory=root, exit_code=7), model=model)
    set_fault_hook(slow_writes)
    at = {}
    try:
        for i in range(100):
            step(model, opt, i)
            at[i + 1] = state(opt)
            if i == 1:
                save_checkpoint(root, opt, asynchronous=True)
            if i == 2 and rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)
    except Preempted as preempted:
        out = {"steps": len(at), "checkpoint": preempted.checkpoint.name, "code": preempted.code}
    finally:
        set_fault_hook(None)
        watch.uninstall()
    _, fresh = make()
    loaded = load_checkpoint(root, fresh)
    out["loaded"] = loaded.tag
    out["same"] = all(torch.equal(v, state(fresh)[k]) for k, v in at[out["steps"]].items())
    return out


def test_pytorch_door_saves_the_same_step_on_a_signal(tmp_path: Path):
    from flatzero.launch import run_ranks

    out = run_ranks(pytorch_door_preempted, 2, str(tmp_path), timeout_s=90)
    assert out[0] == out[1], out
    assert out[0]["steps"] == 3 and out[0]["checkpoint"] == "step3", out  # the next boundary
    assert out[0]["code"] == 7 and out[0]["loaded"] == "step3" and out[0]["same"], out
    assert read_latest(tmp_path) == "step3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step2", "step3"]


def test_hugging_face_route_saves_on_a_signal(tmp_path: Path):
    """An Accelerate loop through ``patch_deepspeed()`` with ``preemption_dir`` in its
    DeepSpeed config, one process: SIGUSR1 after the 3rd step ends it at the 4th with 138
    (128 + SIGUSR1) and a complete ``global_step4`` that ``latest`` names."""
    pytest.importorskip("accelerate")
    pytest.importorskip("deepspeed")
    from flatzero.ports import free_port

    script = Path(__file__).parent / "preemption_scripts" / "accelerate_loop.py"
    env = {
        **os.environ,
        **{"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"},
        **{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"},
    }
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 128 + signal.SIGUSR1, done.stderr[-3000:]
    assert "preempted by SIGUSR1: saved" in done.stderr, done.stderr[-3000:]
    assert read_latest(tmp_path / "ckpt") == "global_step4"
    assert saved_step(tmp_path / "ckpt") == 4


def test_the_ranks_agree_every_check_every_boundaries_and_the_handler_only_notes():
    """One process (no collective): SIGUSR1, sent twice for real, is noted once and
    acted on at the next ``check_every``-th boundary only; the handlers come off after."""
    from flatzero.checkpoint import PreemptionConfig, SignalWatch

    before = signal.getsignal(signal.SIGUSR1)
    watch = SignalWatch(PreemptionConfig(directory="x", check_every=3), None).install()
    try:
        assert watch.agree() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert list(watch.came) == [signal.SIGUSR1]
        assert watch.agree() is None  # boundary 2: no agreement
        age, signum = watch.agree()  # boundary 3
        assert signum == signal.SIGUSR1 and 0 <= age < 60
    finally:
        watch.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == before
    with pytest.raises(ValueError, match="not a signal of this system"):
        PreemptionConfig(directory="x", signals=("SIGNOPE",))
    with pytest.raises(ValueError, match="check_every must be a positive int"):
        PreemptionConfig(directory="x", check_every=0)
