"""Smoke test of ``flatzero bench offload`` at tiny sizes (no DeepSpeed: seconds)."""

from __future__ import annotations

import json

from flatzero.cli import main


def test_offload_kernel_benchmark_runs_and_reports(tmp_path, capsys):
    out = tmp_path / "offload.json"
    argv = ["bench", "offload", "--what", "kernel", "--numel", "4096", "--runs", "1"]
    argv += ["--kernel-threads", "1", "--kernel-steps", "2", "--kernel-warmup", "1"]
    argv += ["--no-deepspeed", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    rows = {r["method"]: r for r in result["kernel"]["rows"]}
    assert set(rows) == {"flatzero", "torch_foreach", "torch_single"}
    for row in rows.values():
        assert row["steps"] == 2 and row["step_s_median"] > 0
        # The same AdamW over the same tensor and gradients: the same result, to rounding.
        assert row["param_max_abs_diff"] < 1e-6
    assert result["command"] == "flatzero " + " ".join(argv)
