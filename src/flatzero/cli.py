"""The ``flatzero`` command line (also ``python -m flatzero``)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from . import harness

__all__ = ["USER_ERRORS", "main", "one_line"]

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


def _parser(with_bench: bool = True) -> argparse.ArgumentParser:
    """The command line's parser; ``with_bench=False`` leaves the benchmark harness
    unimported (``flatzero bench`` then only takes the rest of the line, unread), as does
    a flatzero without the harness (``flatzero bench`` then says where it lives)."""
    parser = argparse.ArgumentParser(
        prog="flatzero",
        description="ZeRO-1/2 for PyTorch with initialization as fast as the hardware allows.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error in the input"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, devices and tiers")
    info.set_defaults(run=_info)

    from . import demo
    from .plan import cli as plan_cli

    plan_cli.add_info_arguments(info)
    from .checkpoint import export
    from .deepspeed.convert import cli as convert_cli

    def command(subparsers, name: str, help_text: str, add_arguments, run) -> None:
        p = subparsers.add_parser(name, help=help_text)
        add_arguments(p)
        p.set_defaults(run=run)

    command(sub, "demo", "the DeepSpeed door end to end, in under a minute",
            demo.add_arguments, demo.run)  # fmt: skip
    command(sub, "export", "consolidated safetensors weights of a checkpoint",
            export.add_export_arguments, export.export_main)  # fmt: skip
    command(sub, "import-deepspeed", "a DeepSpeed ZeRO-1/2 checkpoint as a flatzero checkpoint",
            convert_cli.add_import_arguments, convert_cli.import_main)  # fmt: skip
    command(sub, "export-deepspeed", "a flatzero checkpoint as a DeepSpeed ZeRO-1/2 checkpoint",
            convert_cli.add_export_arguments, convert_cli.export_main)  # fmt: skip
    command(sub, "plan", "predict memory, tier, bytes per link and init time of a job",
            plan_cli.add_arguments, plan_cli.run)  # fmt: skip
    bench = sub.add_parser("bench", help="benchmarks against baselines and hardware limits")
    if not with_bench or not harness.find_harness():
        # another command runs, or no harness here: it stays unimported (flatzero.harness)
        bench.add_argument("rest", nargs=argparse.REMAINDER)
        bench.set_defaults(run=_harness_missing)
        return parser
    from flatzero_bench.commands import add_benchmarks

    add_benchmarks(bench, command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((word for word in argv if not word.startswith("-")), None)
    args = _parser(with_bench=command in (None, "bench")).parse_args(argv)
    args.argv = argv  # for the command line a benchmark records with its results
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        return int(args.run(args) or 0)
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
