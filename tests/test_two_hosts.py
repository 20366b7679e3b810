"""A real two-host run: ``torchrun --nnodes 2 --nproc-per-node 2`` across two network
namespaces joined by a veth pair, against the same job on one host.

The test makes two hosts of its own: network namespaces ``A`` and ``B`` with ``lo`` up and
one veth pair between them on a private /30 (no route to anything else). Each runs a
torchrun agent with c10d rendezvous at ``A``'s address, two local ranks each (world size
4, gloo over the veth: ``GLOO_SOCKET_IFNAME``), training a tiny Llama with
``flatzero.initialize`` at ZeRO stage 2 (``tests/multihost_scripts/train_zero2.py``) and
saving a checkpoint with all four ranks. Then, on the normal host:

- the same script under ``torchrun --standalone --nproc-per-node 4`` gives the same
  losses, bit for bit (same world size, same per-rank data, one intra-op thread per
  rank in both, and gloo's reductions depend on the ranks, not on where they run), and
  the same final weights;
- the two-host checkpoint, loaded at world size 2, gives bitwise the weights the
  one-host world-size-4 run ended with;
- the ranks of ``B`` are global ranks 2 and 3 with local ranks 0 and 1 (asserted inside
  the script too), and the control group agrees across hosts;
- flatzero counts the ranks sharing a machine's cores through the process group, not
  from ``LOCAL_WORLD_SIZE``: the two "hosts" are network namespaces of one kernel (one
  host name, one boot id) sharing its cores, so all four ranks are on one host for the
  core share, though torchrun says two per node.

A launch that fails ends the wait at once (its peers would wait on it); when a rank died
of gloo's own abort while connecting (``GLOO_ABORT``), the runs are made once more.

Skipped where network namespaces cannot be made (not root, no ``ip``, ``ip netns add``
refused). Namespaces are named after the pid and deleted (with their veths) even when
the run fails.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gloo_abort import GLOO_ABORT, GLOO_ABORT_RETRIES

SCRIPT = Path(__file__).resolve().parent / "multihost_scripts" / "train_zero2.py"
pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 180.0
"""For each phase (the two-host and one-host runs side by side, then the reload): each
took 10-25 s on the 2-core development machine, depending on what else ran there."""
RDZV_PORT = 29400
"""Free by construction: host A is a fresh network namespace."""


@dataclass(frozen=True)
class Host:
    label: str
    netns: str
    veth: str
    addr: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


@pytest.fixture(scope="module")
def hosts():
    """Two network namespaces joined by a veth pair, each end on a /30."""
    if sys.platform != "linux":
        pytest.skip("network namespaces are Linux only")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` binary (iproute2); scripts/setup.sh installs it as root")
    pid = os.getpid()
    # A private /30 picked from the pid (the namespaces see nothing else anyway).
    net = f"10.{200 + pid % 50}.{(pid // 50) % 256}"
    a = Host("A", f"fz{pid}a", f"vfz{pid}a", f"{net}.1")
    b = Host("B", f"fz{pid}b", f"vfz{pid}b", f"{net}.2")
    made: list[str] = []

    def setup(*args: str) -> None:
        done = _ip(*args, check=False)
        if done.returncode != 0:
            pytest.skip(f"cannot make the test's hosts: `ip {' '.join(args)}` failed: "
                        f"{done.stderr.strip()}")  # fmt: skip

    try:
        for h in (a, b):
            _ip("netns", "del", h.netns, check=False)  # left by a killed run of this pid
            setup("netns", "add", h.netns)
            made.append(h.netns)
        # Both ends are created inside their namespaces: nothing is left in the host's.
        setup("link", "add", a.veth, "netns", a.netns, "type", "veth",
              "peer", "name", b.veth, "netns", b.netns)  # fmt: skip
        for h in (a, b):
            setup("-n", h.netns, "link", "set", "lo", "up")
            setup("-n", h.netns, "addr", "add", f"{h.addr}/30", "dev", h.veth)
            setup("-n", h.netns, "link", "set", h.veth, "up")
        yield a, b
    finally:
        for ns in made:  # deleting a namespace deletes its veth end, and so the pair
            _ip("netns", "del", ns, check=False)


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (torchrun starts its workers in new sessions, so
    a process group does not reach them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    for pid in [*_descendants(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _launch(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("w") as f:
        return subprocess.Popen(args, env=env, stdout=f, stderr=subprocess.STDOUT)


def _wait_all(procs: list[tuple[subprocess.Popen, Path]], what: str) -> str | None:
    """Wait for every launch. The first one to fail, or ``RUN_TIMEOUT_S`` passing, ends
    the wait and kills what is left (a rank that died leaves its peers waiting on it).
    Returns None when all succeeded, else what happened and every launch's log."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        codes = [p.poll() for p, _ in procs]
        if any(code not in (None, 0) for code in codes) or None not in codes:
            break
        time.sleep(0.5)
    hung = [p for p, _ in procs if p.poll() is None]
    for p in hung:
        _kill_tree(p)
    if not hung and all(p.returncode == 0 for p, _ in procs):
        return None
    logs = "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for _, log in procs)
    timed_out = time.monotonic() >= deadline
    state = f"hung past {RUN_TIMEOUT_S:.0f} s" if timed_out else "failed"
    return f"{what} {state}:\n{logs}"


def _run_all(launch: Callable[[], list[tuple[subprocess.Popen, Path]]], what: str) -> None:
    """``launch()`` and wait; again, up to ``GLOO_ABORT_RETRIES`` times, if a rank died of
    gloo's connect-time abort (``GLOO_ABORT``), which is gloo's, not flatzero's; fail with
    the logs otherwise."""
    failure = _wait_all(launch(), what)
    for attempt in range(GLOO_ABORT_RETRIES):
        if failure is None or GLOO_ABORT not in failure:
            break
        failure = _wait_all(launch(), f"{what} (run {attempt + 2}, after gloo aborted a rank)")
    if failure is not None:
        pytest.fail(failure)


def _script_args(mode: str, out: Path, ckpt: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    return [str(SCRIPT), "--mode", mode, "--out", str(out), "--ckpt", str(ckpt)]


def _script():
    """The training script as a module (for its model)."""
    spec = importlib.util.spec_from_file_location("flatzero_two_hosts_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _records(out: Path, world_size: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


@pytest.fixture(scope="module")
def runs(hosts, tmp_path_factory):
    """The two-host run and, beside it, the one-host run at world size 4; then the
    two-host checkpoint reloaded at world size 2."""
    a, b = hosts
    root = tmp_path_factory.mktemp("two_hosts")
    # torchrun gives every rank one intra-op thread (OMP_NUM_THREADS=1) when it starts
    # several per node and the variable is unset: the same in every run here.
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}

    def torchrun(name: str, args: list[str], prefix: tuple[str, ...] = (), **extra: str):
        log = root / f"{name}.log"
        cmd = [*prefix, sys.executable, "-m", "torch.distributed.run", *args]
        return _launch(cmd, {**env, **extra}, log), log

    two_ckpt = root / "two_hosts_ckpt"

    def side_by_side():
        for path in ("two_hosts", "one_host", "one_host_ckpt", two_ckpt):
            shutil.rmtree(root / path, ignore_errors=True)
        rdzv_id = f"flatzero-two-hosts-{os.getpid()}-{time.monotonic_ns()}"  # fresh per try
        launches = [
            torchrun(
                f"host_{h.label}",
                [
                    "--nnodes", "2", "--nproc-per-node", "2",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{a.addr}:{RDZV_PORT}",
                    "--rdzv-id", rdzv_id,
                    "--rdzv-conf", f"is_host={int(h is a)},join_timeout=120",
                    "--local-addr", h.addr, "--max-restarts", "0",
                    *_script_args("train", root / "two_hosts", two_ckpt),
                ],
                prefix=("ip", "netns", "exec", h.netns),
                GLOO_SOCKET_IFNAME=h.veth,
                FLATZERO_TEST_HOST=h.label,
            )
            for h in (a, b)
        ]  # fmt: skip
        launches.append(
            torchrun(
                "one_host",
                ["--standalone", "--nproc-per-node", "4",
                 *_script_args("train", root / "one_host", root / "one_host_ckpt")],
            )
        )  # fmt: skip
        return launches

    _run_all(side_by_side, "the two-host run and the one-host run at world size 4")
    _run_all(
        lambda: [
            torchrun(
                "reload",
                ["--standalone", "--nproc-per-node", "2",
                 *_script_args("reload", root / "reload", two_ckpt)],
            )
        ],
        "the reload at world size 2",
    )  # fmt: skip
    return {
        "hosts": (a, b),
        "two": _records(root / "two_hosts", 4),
        "one": _records(root / "one_host", 4),
        "reload": _records(root / "reload", 2),
        "weights_two": load_file(root / "two_hosts" / "weights.safetensors"),
        "weights_one": load_file(root / "one_host" / "weights.safetensors"),
        "weights_reload": load_file(root / "reload" / "weights.safetensors"),
        "two_ckpt": two_ckpt,
    }


def test_ranks_span_both_hosts_with_local_ranks(runs):
    a, b = runs["hosts"]
    two = runs["two"]
    assert [r["rank"] for r in two] == [0, 1, 2, 3]
    # The rendezvous orders the agents by address: A (.1) is node 0, B (.2) node 1.
    assert [(r["host"], r["group_rank"], r["local_rank"]) for r in two] == [
        ("A", 0, 0),
        ("A", 0, 1),
        ("B", 1, 0),
        ("B", 1, 1),
    ]
    for r in two:
        host = a if r["host"] == "A" else b
        assert r["gloo_ifname"] == host.veth
        assert r["master_addr"] == a.addr  # the store of node 0, reached across the veth
        assert (r["world_size"], r["local_world_size_env"]) == (4, 2)
    for r in runs["one"]:
        assert r["local_rank"] == r["rank"]


def test_core_share_counts_the_ranks_sharing_the_machine_not_the_launchers_variable(runs):
    for run, local in (("two", 2), ("one", 4)):
        for r in runs[run]:
            share = r["core_share"]
            assert share["launcher_says"] == f"LOCAL_WORLD_SIZE={local}"
            # Namespaces of one kernel: every rank of the job shares this machine's cores.
            assert (share["ranks_on_host"], share["ranks_sharing_cores"]) == (4, 4)
            assert share["threads"] == r["init_threads"] == max(1, r["usable_cores"] // 4)


def test_control_group_agrees_across_hosts(runs):
    for r in runs["two"]:
        # On gloo the process group is its own control group; the last rank's (host B)
        # planted error reached every rank, on both hosts.
        assert r["control_is_world"]
        assert r["agreed_error"] == (
            "planted on the last rank"
            if r["rank"] == 3
            else "failed on another rank: rank 3: RuntimeError: planted on the last rank"
        )


def test_two_hosts_train_exactly_as_one_host(runs):
    two, one = runs["two"], runs["one"]
    assert [r["tiers"] for r in two] == [r["tiers"] for r in one]
    for r2, r1 in zip(two, one, strict=True):
        assert len(r2["losses"]) == 5
        assert all(torch.isfinite(torch.tensor(r2["losses"])))
        assert r2["losses"] == r1["losses"], r2["rank"]
        assert r2["mean_losses"] == r1["mean_losses"]
    # Every rank saw the same global mean, and each rank its own data.
    assert len({tuple(r["mean_losses"]) for r in two}) == 1
    assert len({tuple(r["losses"]) for r in two}) == 4
    w2, w1 = runs["weights_two"], runs["weights_one"]
    assert w2.keys() == w1.keys()
    for name in w1:
        assert torch.equal(w2[name], w1[name]), name


def test_two_host_checkpoint_reloads_at_world_size_two(runs):
    ckpt = runs["two_ckpt"] / "final"
    assert sorted(p.name for p in ckpt.glob("rank_*")) == [
        f"rank_{r:05d}-of-00004.safetensors" for r in range(4)
    ]
    assert json.loads((ckpt / "meta.json").read_text())["world_size"] == 4
    reload = runs["reload"]
    assert [(r["rank"], r["world_size"]) for r in reload] == [(0, 2), (1, 2)]
    assert all(r["global_steps"] == 5 for r in reload)
    loaded, trained = runs["weights_reload"], runs["weights_one"]
    assert loaded.keys() == trained.keys()
    for name in trained:
        assert torch.equal(loaded[name], trained[name]), name
    # Training moved the weights (so the equality above is not of two inits).
    init = dict(_script().make_model(seed=0).named_parameters())
    assert all(not torch.equal(init[n].detach(), trained[n]) for n in trained)
