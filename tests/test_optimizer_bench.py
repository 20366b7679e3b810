"""Smoke test of ``flatzero bench step`` (world size 1, no DeepSpeed: a few seconds)."""

from __future__ import annotations

import json

import pytest

from flatzero.cli import main


def test_step_benchmark_runs_and_reports(tmp_path, capsys):
    out_json, out_md = tmp_path / "step.json", tmp_path / "step.md"
    argv = ["bench", "step", "--model", "tiny", "--world-sizes", "1"]
    argv += ["--steps", "2", "--warmup", "1"]
    argv += ["--batch", "1", "--seq", "16", "--no-deepspeed"]
    argv += ["--json", str(out_json), "--markdown", str(out_md)]
    assert main(argv) == 0
    result = json.loads(out_json.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    rows = {row["method"]: row for row in result["rows"]}
    assert set(rows) == {"flatzero-z2", "torch-adamw", "torch-adamw-fused"}
    for row in rows.values():
        assert row["timed_steps"] == 2 and row["bwd_s"] > 0 and row["step_s"] > 0
        assert set(row["ratios"]) == {"torch-adamw", "torch-adamw-fused"}
        # The same training: every method ends at (nearly) the same loss.
        assert row["final_loss"] == pytest.approx(rows["torch-adamw"]["final_loss"], rel=1e-4)
    assert result["command"] == "flatzero " + " ".join(argv)
    text = out_md.read_text()
    assert f"Command: `{result['command']}`" in text and "| 1 | flatzero-z2 |" in text
