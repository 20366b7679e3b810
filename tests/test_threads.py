"""Issue 23, items 1-2: a rank's share of its host's cores (``flatzero.cores``).

Item 1: the share is the usable cores (affinity, cgroup CPU quota) over the ranks on the
host, counted through the process group, never taken from a launcher's variable. Item 2:
init runs with the whole share whatever ``OMP_NUM_THREADS`` or the user set, and gives the
user's setting back. The launchers end to end: ``tests/test_launchers.py``.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flatzero.own_groups as own_groups
from flatzero import FlattenConfig, OffloadConfig, ZeroOptimizer, flatten_parameters
from flatzero import cores as threads
from flatzero.cores import (
    LAUNCHER_LOCAL_SIZES,
    CoreShare,
    cgroup_cpu_quota,
    core_share,
    init_threads,
    usable_cores,
)
from flatzero.flatten import api
from flatzero.launch import run_ranks

needs_affinity = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS"
)


def _expected_usable() -> int:
    """The affinity mask's CPUs, capped by the cgroup quota (rounded down)."""
    cores = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota()
    return cores if quota is None else max(1, min(cores, math.floor(quota)))


# ------------------------------------------------------------- the cgroup quota
def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _v2_layout(tmp_path: Path, cpu_max: dict[str, str], cgroup: str = "/job.slice/rank") -> dict:
    """A cgroup v2 mount under ``tmp_path`` with ``cpu.max`` per cgroup path (relative
    to the mount), this process in ``cgroup``; the arguments of ``cgroup_cpu_quota``."""
    mount = tmp_path / "cg2"
    (mount / cgroup.lstrip("/")).mkdir(parents=True, exist_ok=True)
    for rel, text in cpu_max.items():
        _write(mount / rel / "cpu.max", text + "\n")
    mountinfo = tmp_path / "mountinfo"
    _write(
        mountinfo,
        "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
        f"30 22 0:26 / {mount} rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw\n",
    )
    proc_cgroup = tmp_path / "cgroup"
    _write(proc_cgroup, f"0::{cgroup}\n")
    return {"mountinfo": mountinfo, "proc_cgroup": proc_cgroup}


@pytest.mark.parametrize(
    ("cpu_max", "cores"),
    [("max 100000", None), ("150000 100000", 1.5), ("200000 50000", 4.0), ("max", None)],
)
def test_cgroup_v2_cpu_max_is_the_quota_in_cores(tmp_path, cpu_max, cores):
    assert cgroup_cpu_quota(**_v2_layout(tmp_path, {"job.slice/rank": cpu_max})) == cores


def test_cgroup_v2_quota_is_the_tightest_of_the_cgroup_and_its_ancestors(
    tmp_path,
):
    files = {"job.slice/rank": "max 100000", "job.slice": "300000 100000", "": "max 100000"}
    assert cgroup_cpu_quota(**_v2_layout(tmp_path, files)) == 3.0
    files["job.slice/rank"] = "250000 100000"
    assert cgroup_cpu_quota(**_v2_layout(tmp_path, files)) == 2.5
    files["job.slice/rank"] = "800000 100000"
    assert cgroup_cpu_quota(**_v2_layout(tmp_path, files)) == 3.0


def test_cgroup_v1_cfs_quota_on_a_hybrid_host(tmp_path):
    # The cpu controller on v1 (at a mount point with a space in it), beside an empty v2
    # hierarchy, as systemd's hybrid layout has it; this machine's layout too.
    cpu = tmp_path / "cg v1" / "cpu,cpuacct"
    unified = tmp_path / "unified"
    leaf = cpu / "docker" / "abc"
    _write(leaf / "cpu.cfs_quota_us", "250000\n")
    _write(leaf / "cpu.cfs_period_us", "100000\n")
    _write(cpu / "cpu.cfs_quota_us", "-1\n")
    _write(cpu / "cpu.cfs_period_us", "100000\n")
    unified.mkdir()
    escaped = str(cpu).replace(" ", "\\040")
    mountinfo = tmp_path / "mountinfo"
    _write(
        mountinfo,
        f"32 31 0:29 / {escaped} rw,nosuid,relatime shared:9 - cgroup cgroup rw,cpu,cpuacct\n"
        f"33 31 0:30 / {tmp_path}/memory rw,relatime - cgroup cgroup rw,memory\n"
        f"41 31 0:38 / {unified} rw,relatime - cgroup2 cgroup2 rw\n",
    )
    proc_cgroup = tmp_path / "cgroup"
    _write(proc_cgroup, "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/docker/abc\n")
    assert cgroup_cpu_quota(mountinfo, proc_cgroup) == 2.5
    _write(leaf / "cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_quota(mountinfo, proc_cgroup) is None


def test_cgroup_seen_from_inside_a_container(tmp_path):
    # Without a cgroup namespace the mount shows the container's own cgroup at its mount
    # point: its root field is that cgroup, and the process's path is not below the mount.
    mount = tmp_path / "cpu"
    _write(mount / "cpu.cfs_quota_us", "150000\n")
    _write(mount / "cpu.cfs_period_us", "100000\n")
    mountinfo = tmp_path / "mountinfo"
    _write(mountinfo, f"32 31 0:29 /kubepods/pod1 {mount} rw - cgroup cgroup rw,cpu\n")
    proc_cgroup = tmp_path / "cgroup"
    _write(proc_cgroup, "4:cpu:/kubepods/pod1\n")
    assert cgroup_cpu_quota(mountinfo, proc_cgroup) == 1.5
    _write(proc_cgroup, "4:cpu:/elsewhere\n")
    assert cgroup_cpu_quota(mountinfo, proc_cgroup) == 1.5


def test_no_cgroup_files_means_no_quota(tmp_path):
    assert cgroup_cpu_quota(tmp_path / "none", tmp_path / "none") is None


def test_usable_cores_are_capped_by_the_quota(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda: 1.5)
    assert usable_cores() == 1
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda: 0.5)
    assert usable_cores() == 1
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda: cores + 10.0)
    assert usable_cores() == cores
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda: None)
    assert usable_cores() == cores


def test_the_quota_bounds_the_share(monkeypatch):
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda: 1.5)
    share = core_share(None)
    assert (share.threads, share.quota_cores, share.ranks_on_host) == (1, 1.5, 1)
    assert share.affinity_cores == len(os.sched_getaffinity(0))


def test_the_report_says_how_the_share_was_derived():
    share = CoreShare(
        threads=3,
        affinity_cores=16,
        quota_cores=12.5,
        ranks_on_host=4,
        ranks_sharing_cores=4,
        launcher_says="LOCAL_SIZE=4",
    )
    assert share.describe() == (
        "3 threads per rank (16 cores in affinity / 4 ranks sharing them; quota 12.5 "
        "cores / 4 ranks on host; launcher: LOCAL_SIZE=4)"
    )
    flat = flatten_parameters(nn.Linear(4, 4), config=FlattenConfig(progress=False))
    report = flat.report
    assert f"threads: {report.host_threads} (share: {report.core_share.describe()})" in (
        report.facts()
    )
    assert report.to_dict()["core_share"]["ranks_on_host"] == 1


# ------------------------------------------------- ranks counted, not read from env
@pytest.mark.parametrize("name", LAUNCHER_LOCAL_SIZES)
def test_launcher_variables_are_only_a_cross_check(name, monkeypatch, caplog):
    for other in LAUNCHER_LOCAL_SIZES:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, "8")
    with caplog.at_level(logging.WARNING, logger=threads.__name__):
        share = core_share(None)  # no process group: this process is alone
    assert (share.ranks_on_host, share.ranks_sharing_cores) == (1, 1)
    assert share.threads == _expected_usable()
    assert share.launcher_says == f"{name}=8"
    assert f"{name}=8 says 8 rank(s)" in caplog.text


def _pinned_worker(rank: int, world_size: int, how: str) -> dict:
    cpus = sorted(os.sched_getaffinity(0))
    mine = {cpus[0]} if how == "same core" else set(cpus[rank::world_size])
    os.sched_setaffinity(0, mine)
    flat = flatten_parameters(nn.Linear(8, 8), config=FlattenConfig(progress=False))
    share = flat.report.core_share
    return {
        "cpus": len(mine),
        "usable": usable_cores(),
        "share": (share.affinity_cores, share.ranks_on_host, share.ranks_sharing_cores),
        "threads": share.threads,
        "init_threads": flat.report.host_threads,
    }


@needs_affinity
def test_affinity_restricted_ranks_share_only_their_own_cores():
    for r in run_ranks(_pinned_worker, 2, "same core", timeout_s=60):
        assert r["usable"] == 1
        assert r["share"] == (1, 2, 2)
        assert r["threads"] == r["init_threads"] == 1


@needs_affinity
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_ranks_pinned_to_their_own_cores_keep_them():
    quota = cgroup_cpu_quota()
    for r in run_ranks(_pinned_worker, 2, "own cores", timeout_s=60):
        assert r["usable"] == min(r["cpus"], math.floor(quota) if quota else r["cpus"])
        assert r["share"] == (r["cpus"], 2, 1)  # two on the host, none on my cores
        by_quota = math.floor(quota / 2) if quota else r["cpus"]
        assert r["threads"] == r["init_threads"] == max(1, min(r["cpus"], by_quota))


def _subgroup_worker(rank: int, world_size: int) -> dict:
    own_groups._separate_control_needed = lambda group: True  # as on NCCL
    mine, _ = dist.new_subgroups_by_enumeration([[0, 1], [2]])
    created: list = []
    new_group = dist.new_group

    def counting(*args, **kwargs):
        created.append(kwargs.get("ranks"))
        return new_group(*args, **kwargs)

    dist.new_group = counting
    shares = [
        flatten_parameters(
            nn.Linear(8, 8), process_group=mine, config=FlattenConfig(progress=False)
        ).report.core_share.ranks_on_host
        for _ in range(2)
    ]
    dist.barrier()  # the ranks leave together (a rank gone first slows gloo's teardown)
    return {"ranks_on_host": shares, "created": created}


def test_subgroups_count_their_ranks_over_one_reused_control_group():
    # run_ranks sets LOCAL_WORLD_SIZE=3 as torchrun would: all three ranks share this
    # host, whichever group flattens (issue 41 item 2: rank 2's group of one counted 1
    # beside the two flattening ranks of the other group).
    results = run_ranks(_subgroup_worker, 3, timeout_s=60)
    assert [r["ranks_on_host"] for r in results] == [[3, 3], [3, 3], [3, 3]]
    assert [r["created"] for r in results] == [[[0, 1]], [[0, 1]], []]


def _tensor_parallel_worker(rank: int, world_size: int, launcher_var: str | None) -> dict:
    """Data-parallel groups of one rank each (tensor parallelism across this host's ranks):
    the init share and the offloaded optimizer's CPU step threads."""
    for name in LAUNCHER_LOCAL_SIZES:
        os.environ.pop(name, None)
    if launcher_var is not None:
        os.environ[launcher_var] = str(world_size)
    mine, _ = dist.new_subgroups_by_enumeration([[r] for r in range(world_size)])
    model = nn.Linear(8, 8)
    opt = ZeroOptimizer(
        model.parameters(), lr=0.1, process_group=mine, offload_optimizer=OffloadConfig()
    )
    share = opt.flat.report.core_share
    out = {
        "share": (share.ranks_on_host, share.ranks_sharing_cores, share.threads),
        "offload_threads": opt._stepper.threads,
        "usable": usable_cores(),
    }
    dist.barrier()
    return out


@pytest.mark.parametrize("launcher_var", ["LOCAL_WORLD_SIZE", "LOCAL_SIZE"])
def test_data_parallel_groups_of_one_rank_per_host_share_the_hosts_cores(launcher_var):
    for r in run_ranks(_tensor_parallel_worker, 2, launcher_var, timeout_s=60):
        want = max(1, r["usable"] // 2)  # two ranks of the job on this host
        assert r["share"] == (2, 2, want)
        assert r["offload_threads"] == want


def test_without_a_launcher_variable_a_group_of_one_counts_itself():
    for r in run_ranks(_tensor_parallel_worker, 2, None, timeout_s=60):
        assert r["share"] == (1, 1, r["usable"])  # mp.spawn: host_threads sets it by hand


# ------------------------------------------------------ item 2: init owns the share
def _threads_during_init(monkeypatch) -> list[int]:
    seen: list[int] = []
    flatten_groups = api._flatten_groups

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return flatten_groups(*args, **kwargs)

    monkeypatch.setattr(api, "_flatten_groups", recording)
    return seen


@pytest.fixture
def one_thread():
    """The user's setting as under torchrun (``OMP_NUM_THREADS=1``), put back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("host_threads", [None, 3])
def test_init_uses_the_share_whatever_the_user_set(one_thread, monkeypatch, host_threads):
    seen = _threads_during_init(monkeypatch)
    flat = flatten_parameters(
        nn.Linear(10, 10), config=FlattenConfig(progress=False, host_threads=host_threads)
    )
    want = host_threads or _expected_usable()  # one rank: all usable cores
    assert seen == [want]
    assert flat.report.host_threads == want
    assert torch.get_num_threads() == 1


def test_the_users_setting_is_back_after_an_error(one_thread, monkeypatch):
    def failing(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(api, "_flatten_groups", failing)
    with pytest.raises(RuntimeError, match="planted"):
        flatten_parameters(nn.Linear(10, 10), config=FlattenConfig(progress=False))
    assert torch.get_num_threads() == 1
    with pytest.raises(ValueError, match="inside"), init_threads(2) as used:
        assert used == torch.get_num_threads() == 2
        raise ValueError("inside")
    assert torch.get_num_threads() == 1


def test_counts_read_in_the_singular_and_the_plural():
    from flatzero.words import plural

    assert [plural(1, "rank"), plural(2, "rank"), plural(0, "thread")] == [
        "1 rank", "2 ranks", "0 threads"
    ]  # fmt: skip
