"""Every CLI subcommand is wired and parses its options."""

from __future__ import annotations

import pytest

from flatzero.cli import main


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["demo", "--help"],
        ["export", "--help"],
        ["import-deepspeed", "--help"],
        ["export-deepspeed", "--help"],
        ["bench", "init", "--help"],
        ["bench", "step", "--help"],
        ["bench", "load", "--help"],
    ],
)
def test_subcommands_parse(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    assert "usage: flatzero" in capsys.readouterr().out


def test_info_runs(capsys):
    assert main(["info"]) == 0
    assert "tiers: auto, device, host, sharded, offload, cpu" in capsys.readouterr().out
