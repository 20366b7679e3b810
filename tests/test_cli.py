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
    assert "tiers: auto, device, host, sharded, host_park, cpu" in capsys.readouterr().out


def _exit(argv: list[str], capsys) -> tuple[int, str]:
    """``main(argv)``'s exit status (argparse's too) and its stderr."""
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    captured = capsys.readouterr()
    return code, captured.err


# (argv with {tmp} for the test's directory, a text the one error line must hold)
_BAD_COMMANDS: list[tuple[list[str], str]] = [
    (["export", "{tmp}/nope", "{tmp}/out"], "{tmp}/nope"),
    (["import-deepspeed", "{tmp}/nope", "{tmp}/out"], "{tmp}/nope"),
    (["import-deepspeed", "{tmp}/nope", "{tmp}/out", "--world-size", "100000000"],
     "--world-size: 100000000 is not in [1, 65536]"),
    (["import-deepspeed", "{tmp}/nope", "{tmp}/out", "--bucket-numel", "many"],
     "--bucket-numel: 'many' is not a whole number"),
    (["export-deepspeed", "{tmp}/nope", "{tmp}/out", "--world-size", "0"],
     "--world-size: 0 is not in [1, 65536]"),
    (["export-deepspeed", "{tmp}/nope", "{tmp}/out", "--world-size", "2", "--ds-config", "{tmp}"],
     "config file '{tmp}' is a directory"),
    (["plan", "--model", "no-such-model"], "no-such-model"),
    (["plan", "--model", "qwen3-moe-narrow-unfused", "--layers", "-5"],
     "--layers: -5 is not in [1, 100000]"),
    (["plan", "--model", "qwen3-moe-narrow-unfused", "--json", "{tmp}"], "Is a directory"),
    (["demo", "--world-size", "100000"], "--world-size: 100000 is not in [1, 64]"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "expected"), _BAD_COMMANDS, ids=[" ".join(a)[:60] for a, _ in _BAD_COMMANDS]
)
def test_a_bad_input_is_one_line_and_exit_status_2(argv, expected, tmp_path, capsys):
    before = sorted(tmp_path.rglob("*"))
    code, err = _exit([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    assert code == 2, err
    lines = [line for line in err.splitlines() if "error:" in line]  # argparse: usage too
    assert len(lines) == 1 and lines[0].startswith("flatzero"), err
    assert "Traceback" not in err
    assert expected.replace("{tmp}", str(tmp_path)) in lines[0], err
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


_LLAMA = {
    "model_type": "llama",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}

# (a change to a valid config.json, a text the one error line must hold)
_BAD_MODEL_CONFIGS: list[tuple[dict, str]] = [
    ({"num_hidden_layers": 10**9}, "num_hidden_layers=1000000000 is more than 10,000"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive int, got 0"),
    ({"hidden_size": "abc"}, "the config's 'hidden_size' is 'abc'; it must be a whole number"),
    ({"vocab_size": 1.5}, "the config's 'vocab_size' is 1.5"),
    ({"model_type": "no_such_model"}, "model_type 'no_such_model'"),
    ({"hidden_size": 10**15}, "hidden_size=1000000000000000 is more than 10,000,000"),
    ({"vocab_size": 10**15}, "vocab_size=1000000000000000 is more than 10,000,000"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive int, got 0"),
    ({"head_dim": -2}, "head_dim must be a positive int, got -2"),
    ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' is 'yes'; it must be true or false"),
    ({"rms_norm_eps": "abc"}, "'rms_norm_eps' is 'abc'; it must be a number"),
    (
        {"model_type": "qwen3_moe", "moe_intermediate_size": 8, "num_experts": 10**6,
         "num_experts_per_tok": 2},
        "are 2,000,000 experts, more than 1,000,000",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("change", "expected"), _BAD_MODEL_CONFIGS, ids=lambda c: str(c)[:40])
def test_plan_refuses_a_nonsensical_model_config(change, expected, tmp_path, capsys):
    import json
    import time

    (tmp_path / "config.json").write_text(json.dumps({**_LLAMA, **change}))
    t0 = time.perf_counter()
    code, err = _exit(["plan", "--model", str(tmp_path)], capsys)
    assert time.perf_counter() - t0 < 30
    assert code == 2, err
    assert err.count("\n") == 1 and expected in err, err


def test_debug_shows_the_traceback(tmp_path, capsys):
    with pytest.raises((ValueError, OSError)):
        main(["--debug", "export", str(tmp_path / "nope"), str(tmp_path / "out")])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A small flatzero checkpoint and a DeepSpeed one exported from it."""
    import torch
    from torch import nn

    from flatzero.checkpoint import save_checkpoint
    from flatzero.optim import ZeroOptimizer

    root = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    opt = ZeroOptimizer(net.named_parameters(), torch.optim.AdamW, lr=1e-3)
    net(torch.ones(2, 8)).sum().backward()
    opt.step()
    save_checkpoint(root / "ckpt", opt, "t", model=net)
    opt.close()
    assert (
        main(["export-deepspeed", str(root / "ckpt"), str(root / "ds"), "--world-size", "1"]) == 0
    )
    return root


# (argv with {ckpt} and {ds} for the checkpoints and {file} for an existing file, a text
# the one error line must hold): output paths that exist or cannot be made
_BAD_OUTPUTS: list[tuple[list[str], str]] = [
    (["export", "{ckpt}", "{file}"], "'{file}': File exists: it exists and is not a directory"),
    (["export", "{ckpt}", "{file}/out"], "'{file}/out': Not a directory"),
    (["import-deepspeed", "{ds}", "{file}"], "'{file}': File exists"),
    (["import-deepspeed", "{ds}", "{ckpt}"], "{ckpt}/t already exists; choose another out_tag"),
    (["export-deepspeed", "{ckpt}", "{ds}", "--world-size", "1"], "already holds ['t']"),
    (["plan", "--model", "llama-3-8b", "--json", "{file}/plan.json"],
     "'{file}/plan.json': Not a directory: a part of the path is a file"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "expected"), _BAD_OUTPUTS, ids=[" ".join(a)[:60] for a, _ in _BAD_OUTPUTS]
)
def test_an_output_path_that_exists_or_cannot_be_made(argv, expected, checkpoint, capsys):
    file = checkpoint / "a_file"
    file.write_text("keep")

    def fill(text: str) -> str:
        for key, value in (("ckpt", "ckpt"), ("ds", "ds"), ("file", "a_file")):
            text = text.replace("{" + key + "}", str(checkpoint / value))
        return text

    before = {p: p.read_bytes() for p in sorted(checkpoint.rglob("*")) if p.is_file()}
    code, err = _exit([fill(a) for a in argv], capsys)
    assert code == 2, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert fill(expected) in lines[0], err
    after = {p: p.read_bytes() for p in sorted(checkpoint.rglob("*")) if p.is_file()}
    assert after == before  # nothing written or changed


def test_bench_and_demo_say_where_the_harness_lives_when_it_is_missing(monkeypatch, capsys):
    """From a wheel (no ``benchmarks/``), ``flatzero bench`` and ``flatzero demo`` name the
    harness and where it was looked for, in one line with exit status 2."""
    from flatzero import harness

    monkeypatch.setattr(harness, "find_harness", lambda: False)
    monkeypatch.setattr("flatzero.demo.find_harness", lambda: False)
    for argv in (["bench", "init"], ["demo", "--steps", "1"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"flatzero {argv[0]}: error:" in err and "flatzero_bench" in err
        assert "benchmarks" in err and len(err.strip().splitlines()) == 1


def _walk(parser, path=()):
    """Every (command path, action) of ``parser`` and its subparsers, help actions aside;
    a subcommand's line in its parent's help is an action too."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from ((path, line) for line in action._choices_actions)
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_option_has_help_showing_its_default_and_no_markup():
    """Every option of every command (the benchmarks' included) says what it does, shows
    its default when it has one, and carries no reStructuredText markup."""
    from flatzero.cli import HelpFormatter, _parser

    formatter = HelpFormatter("flatzero")
    seen = 0
    for path, action in _walk(_parser()):
        where = " ".join(path) + " " + ("/".join(action.option_strings) or action.dest)
        text = formatter._get_help_string(action)
        assert action.help, f"{where}: no help text"
        assert "``" not in text, f"{where}: markup in {text!r}"
        if action.option_strings and action.default not in (None, False):
            assert "default" in text, f"{where}: the default {action.default!r} is not shown"
        seen += 1
    assert seen > 100  # every command's options were walked, the benchmarks' too


TORCH_FREE = [
    (["--help"], 0),
    (["-v", "--help"], 0),
    (["no-such-command"], 2),
    ([], 2),
    (["demo", "--help"], 0),
    (["demo", "--steps", "many"], 2),
    (["info", "--help"], 0),
    (["info", "--ranks", "many"], 2),
    (["export", "--help"], 0),
    (["export", "ckpt", "out", "--max-shard-size", "5XB"], 2),
    (["import-deepspeed", "--help"], 0),
    (["import-deepspeed", "ds", "out", "--world-size", "0"], 2),
    (["export-deepspeed", "--help"], 0),
    (["export-deepspeed", "ckpt", "out"], 2),  # --world-size is required
    (["plan", "--help"], 0),
    (["plan", "--model", "llama-3-8b", "--stage", "3"], 2),
]
"""Command lines that answer without torch: ``--help`` and an argument error of each command."""


@pytest.mark.parametrize("argv, status", TORCH_FREE)
def test_the_command_line_answers_without_torch(argv, status):
    """``python -m flatzero --help`` and an argument error answer without importing torch
    (which takes seconds): the package's names load on first use, a command's module only
    when that command is named."""
    import os
    import subprocess
    import sys

    code = "import runpy, sys; sys.argv[1:] = {argv!r}\ntry:\n    runpy.run_module('flatzero', run_name='__main__')\nexcept SystemExit as e:\n    print('torch' in sys.modules, e.code)"  # noqa: E501
    done = subprocess.run(
        [sys.executable, "-c", code.format(argv=argv)],
        capture_output=True, text=True, timeout=60, env=os.environ,
    )  # fmt: skip
    assert done.stdout.splitlines()[-1] == f"False {status}", done.stdout + done.stderr


_BENCH_ANSWERS = """
import contextlib, io, json, runpy, sys
from flatzero import harness
assert harness.find_harness()
from flatzero_bench.commands import BENCHMARKS
names = [benchmark[0] for benchmark in BENCHMARKS]
lines = [["bench", "--help"], ["bench"], ["bench", "no-such-benchmark"]]
for name in names:
    lines += [["bench", name, "--help"], ["bench", name, "--no-such-option"]]
answers = []
for argv in lines:
    sys.argv[1:] = argv
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("flatzero", run_name="__main__")
        except SystemExit as e:
            answers.append([argv, e.code, "torch" in sys.modules, err.getvalue()])
print(json.dumps([names, answers]))
"""


def test_bench_answers_its_help_and_argument_errors_without_torch():
    """``python -m flatzero bench --help``, ``bench NAME --help`` of every benchmark, an
    argument error of each, no benchmark named and an unknown one answer without importing
    torch (the parser is built from the benchmarks' ``options`` modules), in one process:
    ``TORCH_FREE``'s check at the cost of one interpreter."""
    import json
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _BENCH_ANSWERS],
        capture_output=True, text=True, timeout=60, env=os.environ,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    names, answers = json.loads(done.stdout.splitlines()[-1])
    assert len(names) >= 10 and len(answers) == 3 + 2 * len(names)
    for argv, code, torch_imported, err in answers:
        assert not torch_imported, f"{' '.join(argv)} imported torch"
        assert code == (0 if argv[-1] == "--help" else 2), (argv, code, err)
    (_, _, _, missing), (_, _, _, unknown) = answers[1:3]
    assert "the following arguments are required: benchmark" in missing
    assert "invalid choice: 'no-such-benchmark'" in unknown
    assert all(name in missing and name in unknown for name in names)  # the choices listed


def test_bench_options_agree_with_the_benchmarks():
    """The names the torch-free options spell (models, dtypes, a default) are their homes'
    (which import torch), and every benchmark's module has the ``run`` the CLI calls."""
    from flatzero import harness
    from flatzero.cli import _function
    from flatzero.models.bench_models import MODELS, STEP_MODELS
    from flatzero.testing.host_ops import HostOpsSpec

    assert harness.find_harness()
    from flatzero_bench.commands import BENCHMARKS
    from flatzero_bench.common import options
    from flatzero_bench.common.settings import BENCH_DTYPES
    from flatzero_bench.host_ops.options import BUCKET_NUMEL

    assert tuple(sorted(MODELS)) == options.MODEL_NAMES
    assert tuple(sorted(STEP_MODELS)) == options.STEP_MODEL_NAMES
    assert tuple(BENCH_DTYPES) == options.BENCH_DTYPE_NAMES
    assert HostOpsSpec.bucket_numel == BUCKET_NUMEL
    for name, _options, module in BENCHMARKS:
        assert callable(_function(f"{module}:run")), name


def test_every_command_answers_its_help_and_argument_errors_without_torch():
    """``TORCH_FREE`` holds ``--help`` and an argument error of every command; their options
    spell the checkpoint's export dtypes as ``checkpoint.config`` does."""
    from flatzero import cli, cli_types
    from flatzero.checkpoint.config import EXPORT_DTYPES
    from flatzero.checkpoint_options import EXPORT_DTYPES as OPTION_DTYPES

    for command in cli.COMMANDS:
        answers = {status for argv, status in TORCH_FREE if argv[:1] == [command.name]}
        assert answers == {0, 2}, command.name
    assert OPTION_DTYPES == EXPORT_DTYPES
    assert cli_types.parse_size("500MiB") == 500 * 2**20


def test_the_public_names_all_load_on_first_use():
    """``flatzero.__all__`` is what loads on first use, every name of it."""
    import flatzero

    assert sorted(flatzero.__all__) == sorted(flatzero._WHERE)
    assert all(getattr(flatzero, name) is not None for name in flatzero.__all__)
    assert set(flatzero.__all__) <= set(dir(flatzero))
