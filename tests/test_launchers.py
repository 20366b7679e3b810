"""Issue 23, items 1-2 end to end: two ranks started the way each launcher starts them,
and the core share each rank's init report shows.

torchrun itself (``python -m torch.distributed.run``) starts its ranks; the other
launchers are not installed here, so the test starts each rank as they would, with
exactly their variables: the DeepSpeed launcher's (``deepspeed/launcher/launch.py``,
DeepSpeed 0.19.8: ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``CROSS_RANK``,
``CROSS_SIZE``, ``LOCAL_SIZE``, ``RANK``, ``LOCAL_RANK``, ``--local_rank=N``; no
``LOCAL_WORLD_SIZE``), Open MPI's ``OMPI_COMM_WORLD_*``, srun's ``SLURM_*``; and
``torch.multiprocessing.spawn`` with no variable at all. Every launcher variable of the
test's own environment is removed first.

Each rank's share must be the usable cores (affinity and cgroup quota, computed here)
over the two ranks of this host, and init must run with it; afterwards each rank's
thread setting is what it was (under torchrun: ``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flatzero.cores import cgroup_cpu_quota
from flatzero.ports import free_port
from gloo_abort import run_again_after_gloo_abort

SCRIPT = Path(__file__).resolve().parent / "launcher_scripts" / "init_share.py"
SRC = Path(__file__).resolve().parents[1] / "src"
WORLD_SIZE = 2
TIMEOUT_S = 120.0
"""Per launch; each took 5-8 s on the 2-core development machine."""

_LAUNCHER_PREFIXES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "GROUP_",
    "ROLE_", "MASTER_", "CROSS_", "OMPI_", "PMI", "MPI_", "SLURM_", "TORCHELASTIC_",
    "OMP_NUM_THREADS",
)  # fmt: skip


def _clean_env() -> dict[str, str]:
    """This process's environment without any launcher's variable, importing flatzero
    from this checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    return env


def _expected_share() -> int:
    """Usable cores (the affinity mask, capped by the cgroup CPU quota) over two ranks."""
    cores = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota()
    usable = cores if quota is None else min(cores, math.floor(quota))
    return max(1, usable // WORLD_SIZE)


def _rank_env(launcher: str, rank: int, port: int) -> dict[str, str]:
    """The variables ``launcher`` sets for ``rank`` of two on one node."""
    if launcher == "deepspeed":
        return {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(WORLD_SIZE),
            "CROSS_RANK": "0",
            "CROSS_SIZE": "1",
            "LOCAL_SIZE": str(WORLD_SIZE),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
        }
    if launcher == "mpirun":
        return {
            "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_SIZE": str(WORLD_SIZE),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_SIZE": str(WORLD_SIZE),
            "OMPI_COMM_WORLD_NODE_RANK": "0",
            "OMPI_UNIVERSE_SIZE": str(WORLD_SIZE),
            "PMIX_RANK": str(rank),
        }
    assert launcher == "slurm"
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_NTASKS": str(WORLD_SIZE),
        "SLURM_NTASKS_PER_NODE": str(WORLD_SIZE),  # srun --ntasks-per-node 2
        "SLURM_TASKS_PER_NODE": str(WORLD_SIZE),
        "SLURM_NODEID": "0",
        "SLURM_NNODES": "1",
        "SLURM_JOB_ID": "23",
    }


def _commands(launcher: str, out: Path) -> list[tuple[list[str], dict[str, str]]]:
    """The processes to start, each with its environment."""
    port = free_port()
    script = [str(SCRIPT), "--launcher", launcher, "--out", str(out)]
    tcp = ["--init-method", f"tcp://127.0.0.1:{port}"]
    if launcher == "torchrun":
        agent = ["-m", "torch.distributed.run", "--standalone", "--max-restarts", "0"]
        cmd = [sys.executable, *agent, "--nproc-per-node", str(WORLD_SIZE), *script]
        return [(cmd, _clean_env())]
    if launcher == "spawn":
        return [([sys.executable, *script, *tcp], _clean_env())]
    per_rank = []
    for rank in range(WORLD_SIZE):
        args = [f"--local_rank={rank}"] if launcher == "deepspeed" else tcp
        env = {**_clean_env(), **_rank_env(launcher, rank, port)}
        per_rank.append(([sys.executable, "-u", *script[:1], *args, *script[1:]], env))
    return per_rank


def _launch(launcher: str, out: Path) -> list[dict]:
    """Start the ranks, wait for them, and return each rank's record, in rank order."""
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, (cmd, env) in enumerate(_commands(launcher, out)):
        with (out / f"proc{i}.log").open("w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(out.glob("*.log")))
    assert all(p.returncode == 0 for p in procs), logs
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


def _assert_share(records: list[dict], launcher_says: str | None) -> None:
    expected = _expected_share()
    for r in records:
        share = r["core_share"]
        assert share["affinity_cores"] == len(os.sched_getaffinity(0))
        assert share["quota_cores"] == cgroup_cpu_quota()
        assert (share["ranks_on_host"], share["ranks_sharing_cores"]) == (2, 2)
        assert share["threads"] == expected, share
        assert r["init_threads"] == expected  # init ran with the whole share
        assert r["threads_after"] == r["threads_before"]  # the user's setting is back
        assert share["launcher_says"] == launcher_says


@pytest.mark.parametrize(
    ("launcher", "launcher_says"),
    [
        ("deepspeed", "LOCAL_SIZE=2"),
        ("mpirun", "OMPI_COMM_WORLD_LOCAL_SIZE=2"),
        ("slurm", "SLURM_NTASKS_PER_NODE=2"),
        ("spawn", None),
    ],
)
def test_every_launcher_shares_the_cores_by_the_ranks_on_the_host(
    launcher, launcher_says, tmp_path
):
    records = _launch(launcher, tmp_path)
    for r in records:
        assert "LOCAL_WORLD_SIZE" not in r["launcher_vars"]
        assert r["omp_num_threads"] is None
    _assert_share(records, launcher_says)


def test_torchrun_omp_one_init_uses_the_whole_share(tmp_path):
    records = _launch("torchrun", tmp_path)
    for r in records:
        # torchrun starts several ranks per node with OMP_NUM_THREADS=1 ...
        assert r["omp_num_threads"] == "1"
        assert r["threads_before"] == 1
        assert "LOCAL_WORLD_SIZE" in r["launcher_vars"]
    # ... and init runs with the share anyway, then gives the rank its one thread back.
    _assert_share(records, "LOCAL_WORLD_SIZE=2")


def _pytorch_door_reference() -> list[list[float]]:
    """Plain ``torch.optim.AdamW`` over each step's whole batch, in one process (the mean
    loss over both halves is what two ranks averaging their gradients train on)."""
    import pytorch_door as door  # tests/launcher_scripts (put on sys.path by the caller)

    net = door.model()
    opt = torch.optim.AdamW(net.parameters(), lr=3e-2)
    for step in range(door.STEPS):
        x, y = door.batch(step)
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().flatten().tolist() for p in net.parameters()]


def test_pytorch_door_under_torchrun_without_a_process_group_is_one_job(tmp_path, monkeypatch):
    """README's ``ZeroOptimizer`` snippet has no ``init_process_group``: under torchrun
    with 2 ranks it must train one model over both ranks' data (the group is made from the
    launcher's variables), never two separate copies."""
    script = SCRIPT.parent / "pytorch_door.py"
    agent = ["-m", "torch.distributed.run", "--standalone", "--max-restarts", "0"]
    cmd = [sys.executable, *agent, "--nproc-per-node", "2", str(script), "--out", str(tmp_path)]
    done = run_again_after_gloo_abort(
        lambda: subprocess.run(
            cmd, env=_clean_env(), capture_output=True, text=True, timeout=TIMEOUT_S
        )
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "WORLD_SIZE=2 but torch.distributed was not initialized" in done.stderr
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in records] == [2, 2]
    assert records[0]["weights"] == records[1]["weights"]  # one model, not two
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    expected = _pytorch_door_reference()
    for got, want in zip(records[0]["weights"], expected, strict=True):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
