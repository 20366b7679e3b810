"""``flatzero demo`` at a small scale: trains, reloads at world size 1, plots."""

from __future__ import annotations

import json

import pytest

from flatzero.cli import _parser
from flatzero.demo import DemoSpec, run_demo


@pytest.mark.slow
def test_demo_small(tmp_path, capsys):
    spec = DemoSpec(steps=8, hidden=128, experts=4, trials=1, door_model="tiny", out=str(tmp_path))
    result = run_demo(spec)
    out = capsys.readouterr().out
    assert result["reload_ok"]
    losses, held = result["losses"], result["held_out"]
    assert len(losses) == 8 and len(held) == 9  # before the first step, after each
    assert held[0] > 5.0 and held[-1] < held[0] * 0.8  # from the uniform guess, visibly down
    # README's order: the init report, flattening alone, training, the reload, the doors
    order = [
        "ZeRO stage 2, fp32, 2 ranks",
        "flattening alone, in process",
        "held-out loss",
        "reloaded at world size 1",
        "flatzero.initialize against deepspeed.initialize",
    ]
    assert [out.index(text) for text in order] == sorted(out.index(text) for text in order)
    assert set(result["init_seconds"]) == {
        "flatzero cpu",
        "flatzero sharded",
        "torch.cat (DeepSpeed 0.19)",
        "CPU cat (DeepSpeed <0.19)",
        "flatzero.initialize",
    }
    assert "flatzero.initialize" in out and "without a GPU every method" in out
    assert "weights match" in out and "reloaded at world size 1" in out
    assert "flatzero.initialize against deepspeed.initialize on tiny" in out
    doors = result["doors"]["doors"]
    assert (
        doors["flatzero"]["init_s"] > 0
        and doors["flatzero"]["ttfs_s"] > doors["flatzero"]["init_s"]
    )
    if "deepspeed" in doors:
        assert doors["deepspeed"]["init_s"] > 0 and "flatzero / deepspeed" in out
    assert (tmp_path / "demo.json").is_file()
    assert json.loads((tmp_path / "demo.json").read_text())["reload_ok"] is True
    if result["plot"] is not None:
        assert (tmp_path / "demo.png").stat().st_size > 1000


def test_demo_cli_arguments(tmp_path):
    args = _parser().parse_args(
        ["demo", "--steps", "3", "--world-size", "2", "--out", str(tmp_path)]
    )
    assert (args.command, args.steps, args.world_size, args.out) == ("demo", 3, 2, str(tmp_path))
    assert callable(args.run)
