"""How long a job takes to end, under real ``torchrun``, after one of its ranks is killed
(kill -9) in the middle of training, and whether the other ranks named it first.

    PYTHONPATH=src:benchmarks python benchmarks/probes/step_fault_job_end.py

3 ranks on this machine, gloo, ``FLATZERO_TIMEOUT=3``. Each trial launches
``torchrun --standalone --nproc-per-node 3`` twice: flatzero's PyTorch door at stage 2
training step after step, and, as the baseline any gloo job gets from torchrun, plain
``torch.distributed`` all-reducing the same model's gradients; once every rank trained two
steps, rank 1 gets SIGKILL, and the seconds to torchrun's exit are measured (and its exit
status, and whether the other ranks' output names rank 1: ``rank 1 is dead``). Prints one
JSON line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

TRIALS = 3
KINDS = ("flatzero", "plain_torch")
_SRC = Path(__file__).resolve().parents[2] / "src"


def _worker(kind: str, out: Path) -> None:
    """One rank: train until killed (at most 120 s); write ``rank<r>.pid`` after step 2."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from flatzero import FlattenConfig, ZeroOptimizer

    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    if kind == "flatzero":
        config = FlattenConfig(bucket_numel=200, progress=False)
        opt = ZeroOptimizer(net.parameters(), stage=2, flatten_config=config, lr=1e-3)
    else:
        dist.init_process_group("gloo")
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    end = time.monotonic() + 120
    step = 0
    while time.monotonic() < end:
        net(torch.randn(4, 8)).square().mean().backward()
        if kind != "flatzero":
            for p in net.parameters():
                dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        step += 1
        if step == 2:
            (out / f"rank{rank}.pid").write_text(str(os.getpid()))


def _trial(kind: str, out: Path) -> dict[str, object]:
    """One launch of ``kind``: seconds from rank 1's kill to torchrun's exit, and more."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_", "LOCAL_"))}
    env.update(PYTHONPATH=f"{_SRC}{os.pathsep}{env.get('PYTHONPATH', '')}", FLATZERO_TIMEOUT="3")
    agent = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts=0"]
    cmd = [*agent, "--nproc-per-node=3", __file__, "--worker", kind, str(out)]
    log = out / "torchrun.log"
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    while len(list(out.glob("rank*.pid"))) < 3:
        if proc.poll() is not None:
            return {"error": log.read_text()[-2000:]}
        time.sleep(0.02)
    pids = [int(p.read_text()) for p in sorted(out.glob("rank*.pid"))]
    os.kill(pids[1], signal.SIGKILL)
    start = time.perf_counter()
    code = proc.wait(timeout=120)
    seconds = time.perf_counter() - start
    text = log.read_text()
    return {"job_end_s": seconds, "exit": code, "named_by": text.count("rank 1 is dead")}


def main() -> None:
    from flatzero_bench.common.machine import describe_host
    from flatzero_bench.common.provenance import utc_timestamp

    load_before = os.getloadavg()
    date = utc_timestamp()
    trials: dict[str, list[dict[str, object]]] = {kind: [] for kind in KINDS}
    for _ in range(TRIALS):
        for kind in KINDS:
            with TemporaryDirectory() as out:
                trials[kind].append(_trial(kind, Path(out)))
    print(
        json.dumps(
            {
                "probe": "step_fault_job_end",
                "command": "PYTHONPATH=src:benchmarks python "
                "benchmarks/probes/step_fault_job_end.py",
                "date": date,
                "machine": describe_host(load_before),
                "world_size": 3,
                "flatzero_timeout_s": 3,
                "trials": trials,
            }
        )
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2], Path(sys.argv[3]))
    else:
        main()
