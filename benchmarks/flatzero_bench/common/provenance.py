"""Where a benchmark result came from: the command line that reproduces it and the date."""

from __future__ import annotations

import argparse
import shlex
import sys
from datetime import datetime, timezone

__all__ = ["command_line", "utc_timestamp"]


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run.

    ``args.argv``, set by the ``flatzero`` CLI, gives ``flatzero bench ...``; a benchmark
    run called another way records the process's own ``sys.argv``.
    """
    argv = getattr(args, "argv", None)
    return shlex.join(["flatzero", *argv] if argv is not None else sys.argv)


def utc_timestamp() -> str:
    """Now, in UTC, as ISO 8601 to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
