"""Smoke test of ``flatzero bench checkpoint`` on the tiny model (one rank, one trial)."""

from __future__ import annotations

import argparse
import json

import pytest

from flatzero_bench.checkpoint import checkpoint_bench


@pytest.mark.parametrize("what", ["load", "save"])
def test_bench_checkpoint_smoke(tmp_path, capsys, what):
    parser = argparse.ArgumentParser()
    checkpoint_bench.add_arguments(parser)
    out = tmp_path / f"{what}.json"
    argv = f"--what {what} --model tiny --world-size 1 --trials 1 --warmup 0 --steps 1"
    args = parser.parse_args([*argv.split(), "--workdir", str(tmp_path), "--out", str(out)])
    assert checkpoint_bench.run(args) == 0
    result = json.loads(out.read_text())
    methods = checkpoint_bench.LOAD_METHODS if what == "load" else checkpoint_bench.SAVE_METHODS
    assert [r["method"] for r in result["rows"]] == list(methods)
    if what == "load":
        assert set(result["verified_over_unverified"]) == {
            "wall_s_median",
            "wall_s_min",
            "cpu_s_median_per_rank",
        }
    else:
        assert result["step_s_median"] > 0 and result["rows"][0]["lost_vs_sync"] == 1.0
    assert result["rows"][0]["method"] in capsys.readouterr().out
