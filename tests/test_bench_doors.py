"""`flatzero bench doors`: the statistics on fixed numbers, and a smoke run on a tiny model."""

from __future__ import annotations

import json

import pytest

from flatzero.cli import main
from flatzero.testing.deepspeed import deepspeed_available
from flatzero_bench.doors.doors_stats import slowest_rank, spread, summarize_run, summarize_runs


def _fig(init: float, ttfs: float, cpu: float = 1.0, share: float = 0.5) -> dict[str, float]:
    return {
        "init_s": init,
        "first_step_s": ttfs - init,
        "ttfs_s": ttfs,
        "bwd_s": (ttfs - init) / 2,
        "step_s": (ttfs - init) / 4,
        "init_cpu_s": cpu,
        "init_cpu_share": share,
        "ttfs_cpu_share": share,
    }


def test_slowest_rank_takes_the_longest_and_the_step_after_the_longest_init():
    record = {
        "ranks": [
            {
                "init_s": 5.0,
                "ttfs_s": 6.0,
                "init_cpu_s": 9.0,
                "ttfs_cpu_s": 10.0,
                "threads": 1,
                "bwd_s": 0.5,
                "step_s": 0.25,
            },
            # finished init first, then waited for rank 0 inside the step's collectives
            {
                "init_s": 3.0,
                "ttfs_s": 5.9,
                "init_cpu_s": 4.0,
                "ttfs_cpu_s": 4.5,
                "threads": 1,
                "bwd_s": 2.5,
                "step_s": 0.25,
            },
        ]
    }
    fig = slowest_rank(record)
    assert fig["init_s"] == 5.0 and fig["ttfs_s"] == 6.0
    assert fig["first_step_s"] == pytest.approx(1.0)
    assert fig["init_cpu_s"] == 9.0
    assert fig["bwd_s"] == 2.5  # the longest, the wait for rank 0 included
    assert fig["init_cpu_share"] == pytest.approx(9.0 / 5.0)
    assert fig["ttfs_cpu_share"] == pytest.approx(10.0 / 6.0)


def test_spread_over_runs_of_each_runs_median_ratio():
    assert spread([3.0, 1.0, 2.0]) == {
        "min": 1.0,
        "median": 2.0,
        "max": 3.0,
        "values": [3.0, 1.0, 2.0],
    }
    with pytest.raises(ValueError):
        spread([])
    # Run 1: paired ratios 1/4, 2/4, 6/4 -> median 0.5; door medians 2 and 4; limit 1.
    run1 = summarize_run(
        {
            "flatzero": [_fig(1.0, 2.0), _fig(2.0, 3.0), _fig(6.0, 7.0)],
            "deepspeed": [_fig(4.0, 5.0), _fig(4.0, 5.0), _fig(4.0, 5.0)],
        },
        limit_s=1.0,
    )
    assert run1["ratio"]["init_s"] == pytest.approx(0.5)
    assert run1["ratio"]["ttfs_s"] == pytest.approx(3.0 / 5.0)
    assert run1["ratio"]["first_step_s"] == pytest.approx(1.0)
    assert run1["doors"]["flatzero"]["init_s"] == 2.0
    assert run1["doors"]["deepspeed"]["x_limit"] == 4.0
    # The median of paired ratios is not the ratio of medians: 1/1, 3/2, 2/4 -> 1.0.
    run2 = summarize_run(
        {
            "flatzero": [_fig(1.0, 2.0), _fig(3.0, 4.0), _fig(2.0, 3.0)],
            "deepspeed": [_fig(1.0, 2.0), _fig(2.0, 3.0), _fig(4.0, 5.0)],
        },
        limit_s=2.0,
    )
    assert run2["ratio"]["init_s"] == pytest.approx(1.0)
    run3 = summarize_run({"flatzero": [_fig(1.0, 2.0)], "deepspeed": [_fig(4.0, 5.0)]}, limit_s=0.5)
    over = summarize_runs([run1, run2, run3])
    init = over["ratio"]["init_s"]
    assert (init["min"], init["median"], init["max"]) == pytest.approx((0.25, 0.5, 1.0))
    assert over["doors"]["flatzero"]["x_limit"]["values"] == pytest.approx([2.0, 1.0, 2.0])
    assert over["limit_s"]["median"] == 1.0
    alone = summarize_runs([summarize_run({"flatzero": [_fig(1.0, 2.0)]}, limit_s=None)])
    assert alone["ratio"] is None and alone["limit_s"] is None
    assert "x_limit" not in alone["doors"]["flatzero"]


def test_bench_doors_smoke(capsys, tmp_path):
    out = tmp_path / "doors.json"
    argv = [
        "bench", "doors", "--model", "tiny", "--world-sizes", "1", "--runs", "1",
        "--trials", "1", "--warmup", "0", "--settle-s", "0", "--limit-repeats", "1",
        "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result == json.loads(out.read_text())
    assert result["benchmark"] == "doors"
    assert result["command"] == "flatzero " + " ".join(argv)
    assert {"date", "machine", "spec"} <= set(result)
    assert result["machine"]["torch"]
    doors = {"flatzero", "deepspeed"} if deepspeed_available()[0] else {"flatzero"}
    assert set(result["spec"]["doors"]) == doors
    (group,) = result["groups"]
    assert group["world_size"] == 1 and group["mode"] == "back-to-back"
    assert group["omp_num_threads"] == str(result["spec"]["omp_num_threads"]["1"])
    (run,) = group["runs"]
    assert run["limit_s"] > 0
    for door in doors:
        figures = run["doors"][door]
        assert figures["init_s"] > 0 and figures["ttfs_s"] > figures["init_s"]
        assert figures["x_limit"] > 0
    launched = [rec for rec in result["launches"] if rec["door"] != "limit"]
    assert {rec["door"] for rec in launched} == doors
    for rec in launched:
        (rank,) = rec["ranks"]
        assert rank["omp_num_threads"] == group["omp_num_threads"]
        assert rank["init_s"] > 0 and rank["first_step_s"] > 0
    if "deepspeed" in doors:
        assert run["ratio"]["init_s"] > 0
        # The same model and batch through either door: the same first forward.
        assert run["loss"]["flatzero"] == run["loss"]["deepspeed"]
    assert any("flatzero / deepspeed" in line for line in lines) == ("deepspeed" in doors)
