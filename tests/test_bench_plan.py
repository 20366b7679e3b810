"""``flatzero bench plan`` predicts with ``flatzero plan``'s model: for the same model and
calibration its seconds are the plan's, for flatzero and for DeepSpeed's CPU path."""

from __future__ import annotations

import json

from flatzero.cli import main
from flatzero_bench.plan.plan_bench import PlanBenchSpec, predict
from plan_fixtures import calibration


def test_the_plan_bench_predicts_what_plan_prints(tmp_path, capsys):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(calibration().to_dict()))
    argv = ["plan", "--model", "tiny", "--gpu", "none", "--gpus-per-node", "2"]
    assert main([*argv, "--calibration", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    spec = PlanBenchSpec("tiny", "bf16", 2**26, 1, 0, 0.0, ("flatzero", "legacy_cpu"))
    guess = predict(spec, 2, calibration())
    assert guess["flatzero"]["seconds"] == data["methods"]["cpu"]["time"]["seconds"]
    assert guess["legacy_cpu"]["seconds"] == data["methods"]["deepspeed_legacy"]["time"]["seconds"]
