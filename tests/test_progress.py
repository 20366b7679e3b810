"""Long work shows progress (rank 0, a terminal, ``FLATZERO_PROGRESS``), and
``import-deepspeed`` stays within its memory bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from flatzero.cli import main
from flatzero.progress import ENV, progress_shown

WIDTH, LAYERS, DS_RANKS = 1024, 8, 4
"""The checkpoint of the memory test: 8.4M params, 96 MiB of fp32 state, 4 DeepSpeed ranks."""


class _Terminal:
    def __init__(self, tty: bool) -> None:
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize(
    "value, tty, rank, wanted, shown",
    [
        (None, True, 0, True, True),
        (None, False, 0, True, False),  # a log file: no bar
        (None, True, 1, True, False),  # rank 0 only
        ("0", True, 0, True, False),  # switched off
        ("off", True, 0, True, False),
        ("1", False, 0, True, True),  # switched on into a log
        ("1", True, 0, False, False),  # the caller's --no-progress wins
        ("1", True, 3, True, False),
    ],
)
def test_when_a_bar_shows(monkeypatch, value, tty, rank, wanted, shown):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    monkeypatch.setattr(sys, "stderr", _Terminal(tty))
    assert progress_shown(rank, wanted) is shown


def _checkpoint(root: Path) -> Path:
    """A small flatzero checkpoint (one rank), saved here."""
    import flatzero

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    opt = flatzero.ZeroOptimizer(model.parameters(), optimizer=torch.optim.AdamW, stage=2)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    flatzero.save_checkpoint(root / "fz", opt, tag="t", model=model)
    return root / "fz"


def test_save_export_and_conversions_show_progress(tmp_path, monkeypatch, capsys):
    """With ``FLATZERO_PROGRESS=1`` (stderr is no terminal under pytest) a save, ``flatzero
    export``, ``export-deepspeed`` and ``import-deepspeed`` each show a bar that reaches
    100%; ``--no-progress`` and ``FLATZERO_PROGRESS=0`` show none."""
    monkeypatch.setenv(ENV, "1")
    fz = _checkpoint(tmp_path)
    assert "flatzero save (rank 0): 100%" in capsys.readouterr().err
    commands = [
        ["export", str(fz), str(tmp_path / "weights")],
        ["export-deepspeed", str(fz), str(tmp_path / "ds"), "--world-size", "2"],
        ["import-deepspeed", str(tmp_path / "ds"), str(tmp_path / "back")],
    ]
    for argv in commands:
        assert main(argv) == 0
        assert f"{argv[0]}: 100%" in capsys.readouterr().err, argv
    for argv in commands:
        assert main([*argv, "--overwrite", "--no-progress"]) == 0
        assert "%|" not in capsys.readouterr().err, argv
    monkeypatch.setenv(ENV, "0")
    assert main([*commands[0], "--overwrite"]) == 0
    assert "%|" not in capsys.readouterr().err


_MEASURE = """
import json, resource, sys, torch, flatzero
from pathlib import Path
from torch import nn
from flatzero.deepspeed.convert import from_deepspeed, to_deepspeed
root, width, layers, ranks = Path(sys.argv[1]), *map(int, sys.argv[2:5])
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
opt = flatzero.ZeroOptimizer(model.parameters(), optimizer=torch.optim.AdamW, stage=2)
model(torch.randn(2, width)).sum().backward()
opt.step()
flatzero.save_checkpoint(root / "fz", opt, tag="t", model=model)
to_deepspeed(root / "fz", root / "ds", world_size=ranks, progress=False)
del model, opt
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
from_deepspeed(root / "ds", root / "back", progress=False)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"before": before, "after": after}))
"""


def test_import_deepspeed_holds_one_rank_file_and_one_state_at_a_time(tmp_path):
    """``import-deepspeed``'s peak host memory above the process's earlier peak stays
    within one DeepSpeed rank file plus one optimizer state of one output rank (plus
    16 MiB of slack), not the checkpoint: 96 MiB of state over 4 DeepSpeed ranks grew the
    peak by ~170 MiB before the import streamed, ~35 MiB after."""
    env = {**os.environ, ENV: "0"}
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(tmp_path), str(WIDTH), str(LAYERS), str(DS_RANKS)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rss = json.loads(done.stdout.splitlines()[-1])
    rank_file = max(p.stat().st_size for p in (tmp_path / "ds" / "t").glob("zero_pp_rank_*"))
    one_state = 4 * (WIDTH * WIDTH + WIDTH) * LAYERS // DS_RANKS
    bound = rank_file + one_state + 16 * 2**20
    grown = rss["after"] - rss["before"]
    assert grown <= bound, f"peak grew {grown / 2**20:.1f} MiB; bound {bound / 2**20:.1f} MiB"
