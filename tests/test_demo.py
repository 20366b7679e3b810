"""``flatzero demo`` at a small scale: trains, reloads at world size 1, plots."""

from __future__ import annotations

import json

import pytest
import torch

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
    from flatzero import demo
    from flatzero.cli import _function

    assert _function(args.run) is demo.run  # imported once the command runs


def test_the_flatten_caveat_says_why_only_when_flatzero_is_slower():
    from flatzero.demo import LEGACY, TORCH_CAT, _flatten_caveat

    times = {"flatzero cpu": 0.2, "flatzero sharded": 0.3, TORCH_CAT: 0.1, LEGACY: 0.15}
    assert "torch.cat beats a bucket loop" in _flatten_caveat(times)
    assert "needs a GPU" in _flatten_caveat(times)
    times["flatzero sharded"] = 0.05
    assert "beats" not in _flatten_caveat(times) and "needs a GPU" in _flatten_caveat(times)


def test_the_held_out_text_is_never_trained_on():
    """The demo trains on some standard library modules' bytes and measures the loss on
    another's: the held-out windows are not in the training text."""
    from flatzero.demo import HELD_OUT_MODULE, TRAIN_MODULES, _text, _windows

    assert HELD_OUT_MODULE not in TRAIN_MODULES
    train = bytes(_text(TRAIN_MODULES, 256).to(torch.uint8).tolist())
    held = _windows(_text((HELD_OUT_MODULE,), 256), 8, 64, seed=0)
    assert held.shape == (8, 64) and int(held.max()) < 256
    assert all(bytes(w.to(torch.uint8).tolist()) not in train for w in held)


def test_the_picture_carries_the_door_to_door_headline(tmp_path):
    pytest.importorskip("matplotlib")
    from flatzero.demo import LEGACY, TORCH_CAT, _plot

    times = {"flatzero cpu": 0.2, "flatzero sharded": 0.3, TORCH_CAT: 0.1, LEGACY: 0.15}
    doors = {
        "doors": {
            "flatzero": {"init_s": 0.2, "first_step_s": 0.1, "ttfs_s": 0.3},
            "deepspeed": {"init_s": 6.0, "first_step_s": 0.2, "ttfs_s": 6.2},
        },
        "ratio": {"init_s": 0.03, "first_step_s": 0.5, "ttfs_s": 0.05},
    }
    rank0 = {"losses": [5.0, 4.0], "held_out": [5.5, 4.5, 4.2]}
    texts: list[str] = []
    import matplotlib.axes

    original = matplotlib.axes.Axes.text

    def record(self, x, y, s, *args, **kwargs):
        texts.append(s)
        return original(self, x, y, s, *args, **kwargs)

    original_label = matplotlib.axes.Axes.set_xlabel

    def record_label(self, label, *args, **kwargs):
        texts.append(label)
        return original_label(self, label, *args, **kwargs)

    matplotlib.axes.Axes.text = record
    matplotlib.axes.Axes.set_xlabel = record_label
    try:
        assert _plot(tmp_path / "demo.png", times, rank0, doors, "t", "tiny")
    finally:
        matplotlib.axes.Axes.text = original
        matplotlib.axes.Axes.set_xlabel = original_label
    assert "flatzero / DeepSpeed\n0.03x" in texts and "flatzero / DeepSpeed\n0.05x" in texts
    assert any("needs a GPU" in t.replace("\n", " ") for t in texts)  # the flatten panel: why
    assert (tmp_path / "demo.png").stat().st_size > 1000
