"""The ``flatzero`` command line (also ``python -m flatzero``)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from . import harness

__all__ = ["COMMANDS", "USER_ERRORS", "Command", "HelpFormatter", "main", "one_line"]

USER_ERRORS = (ValueError, TypeError, OSError)
"""What a command raises for a bad input (a path, a value, a file): one line on stderr and
exit code 2, never a traceback (``--debug`` shows it). Anything else is a bug: traceback."""


def _info(_args: argparse.Namespace) -> int:
    import torch

    import flatzero
    from flatzero import accel
    from flatzero.devices import local_device_index

    print(f"flatzero {flatzero.__version__}, torch {torch.__version__}")
    device_type = accel.accelerator_type()
    if device_type is not None:
        # Free memory needs a device context: only on this rank's device, never on every
        # one (a CUDA context costs each GPU ~500 MiB and would land in other ranks' way).
        mine = local_device_index(device_type)
        for i in range(accel.device_count(device_type)):
            device = torch.device(device_type, i)
            line = f"{device} {accel.device_name(device)}: "
            line += f"{accel.total_memory(device) / 2**30:.1f} GiB"
            if i == mine:
                free, _total = accel.mem_get_info(device)
                line += f", {free / 2**30:.1f} GiB free (this rank's device)"
            print(line)
    else:
        print("no accelerator: flat buffers go to host memory (tier 'cpu')")
    print(f"tiers: {', '.join(flatzero.TIERS)}")
    if getattr(_args, "measure", False):
        from .plan.cli import run_measure

        run_measure(_args)
    return 0


def _harness_missing(_args: argparse.Namespace) -> int:
    raise harness.harness_missing("flatzero bench")


@dataclass(frozen=True)
class Command:
    """A ``flatzero`` subcommand, named by where its parts live so that nothing is imported
    before it runs (``"flatzero.demo:run"``: module and function).

    Attributes:
        name: the word on the command line.
        help: one line for ``flatzero --help``.
        arguments: the function that adds the command's options to its parser.
        run: the function that runs it, given the parsed arguments; returns the exit status.
    """

    name: str
    help: str
    arguments: str
    run: str


COMMANDS: tuple[Command, ...] = (
    Command("info", "versions, devices and tiers",
            "flatzero.plan.options:add_info_arguments", "flatzero.cli:_info"),
    Command("demo", "the DeepSpeed door end to end, against DeepSpeed's",
            "flatzero.demo_spec:add_arguments", "flatzero.demo:run"),
    Command("export", "consolidated safetensors weights of a checkpoint",
            "flatzero.checkpoint_options:add_export_arguments",
            "flatzero.checkpoint.export:export_main"),
    Command("import-deepspeed", "a DeepSpeed ZeRO-1/2 checkpoint as a flatzero checkpoint",
            "flatzero.checkpoint_options:add_import_deepspeed_arguments",
            "flatzero.deepspeed.convert.cli:import_main"),
    Command("export-deepspeed", "a flatzero checkpoint as a DeepSpeed ZeRO-1/2 checkpoint",
            "flatzero.checkpoint_options:add_export_deepspeed_arguments",
            "flatzero.deepspeed.convert.cli:export_main"),
    Command("plan", "predict memory, tier, bytes per link and init time of a job",
            "flatzero.plan.options:add_arguments", "flatzero.plan.cli:run"),
)  # fmt: skip
"""Every subcommand but ``bench`` (the benchmark harness adds its own)."""

BENCH_HELP = "benchmarks against baselines and hardware limits"


def _function(where: str) -> Callable[..., Any]:
    """The function ``"module:name"`` names, its module imported now."""
    module, _, name = where.partition(":")
    return getattr(importlib.import_module(module), name)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default after its help, unless the help already says it or the
    option is a flag (on when given) or has no default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def _command(subparsers: Any, name: str, help_text: str, add_arguments, run) -> None:
    """Add the subcommand ``name`` with its options (``add_arguments(parser)``) and ``run``
    (a function, or ``"module:function"`` imported when it runs; also the benchmark
    harness's way in: ``flatzero_bench.commands.add_benchmarks``)."""
    p = subparsers.add_parser(name, help=help_text, description=help_text,
                              formatter_class=HelpFormatter)  # fmt: skip
    add_arguments(p)
    p.set_defaults(run=run)


def _parser(load: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser, with the options of the commands in ``load`` (None:
    every command). [Note: the CLI answers at once] Only the command that runs is imported:
    ``flatzero --help``, an unknown command or a missing one import no torch, and the
    benchmark harness stays unimported unless ``bench`` runs (a flatzero without the
    harness: ``flatzero bench`` says where it lives); ``bench`` takes its benchmarks'
    torch-free options, a benchmark's module is imported when it runs."""
    parser = argparse.ArgumentParser(
        prog="flatzero",
        description="ZeRO-1/2 for PyTorch with initialization as fast as the hardware allows.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error in the input"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for c in COMMANDS:
        if load is None or c.name in load:  # ``run`` is imported once parsing succeeded
            _command(sub, c.name, c.help, _function(c.arguments), c.run)
        else:
            sub.add_parser(c.name, help=c.help)
    if load is not None and "bench" not in load:
        sub.add_parser("bench", help=BENCH_HELP)
        return parser
    bench = sub.add_parser("bench", help=BENCH_HELP, description=BENCH_HELP)
    if not harness.find_harness():
        bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark and its options")
        bench.set_defaults(run=_harness_missing)
        return parser
    from flatzero_bench.commands import add_benchmarks

    add_benchmarks(bench, _command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((word for word in argv if not word.startswith("-")), None)
    args = _parser(load=() if command is None else (command,)).parse_args(argv)
    args.argv = argv  # for the command line a benchmark records with its results
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    run = _function(args.run) if isinstance(args.run, str) else args.run
    try:
        return int(run(args) or 0)
    except USER_ERRORS as error:
        if args.debug:
            raise
        print(f"flatzero {args.command}: error: {one_line(error)}", file=sys.stderr)
        return 2


_OS_FIXES: tuple[tuple[type[OSError], str], ...] = (
    (FileExistsError, "it exists and is not a directory; choose another output path"),
    (IsADirectoryError, "it is a directory; give the path of a file"),
    (NotADirectoryError, "a part of the path is a file, not a directory; fix the path"),
    (PermissionError, "choose a path this user may read (input) or write (output)"),
    (FileNotFoundError, "check the path"),
)
"""What to do about an ``OSError`` of each kind (the OS's words say what happened)."""


def one_line(error: BaseException) -> str:
    """``error`` as one line: its message's lines joined, an ``OSError`` in the OS's words
    with the file it names and what to do."""
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        fix = next((fix for kind, fix in _OS_FIXES if isinstance(error, kind)), "")
        return f"{error.filename!r}: {error.strerror}" + (f": {fix}" if fix else "")
    text = str(error) or type(error).__name__
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


if __name__ == "__main__":
    sys.exit(main())
