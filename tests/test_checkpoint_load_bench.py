"""Smoke test of ``flatzero bench load`` on the tiny model (one rank, one trial)."""

from __future__ import annotations

import argparse
import json

from flatzero_bench.load import load_bench


def test_bench_load_smoke(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    load_bench.add_arguments(parser)
    out = tmp_path / "load.json"
    args = parser.parse_args(
        [
            "--model",
            "tiny",
            "--world-size",
            "1",
            "--trials",
            "1",
            "--warmup",
            "0",
            "--workdir",
            str(tmp_path),
            "--out",
            str(out),
        ]
    )
    assert load_bench.run(args) == 0
    result = json.loads(out.read_text())
    assert [r["method"] for r in result["rows"]] == list(load_bench.METHODS)
    assert all(r["wall_s_median"] > 0 for r in result["rows"])
    assert "direct_sharded" in capsys.readouterr().out
