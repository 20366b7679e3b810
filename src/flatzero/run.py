"""``python -m flatzero.run``: run a training script with ``deepspeed.initialize`` routed
through flatzero, without changing the script.

Usage (any launcher that runs ``python -m <module>`` on every rank)::

    torchrun --nproc-per-node 8 -m flatzero.run train.py --deepspeed ds_config.json ...
    accelerate launch --use_deepspeed ... -m flatzero.run train.py ...
    python -m flatzero.run -m my_package.train ...      # a script run as a module

It applies ``flatzero.patch_deepspeed()``, then runs the script as ``__main__`` with
``sys.argv`` and ``sys.path[0]`` as ``python train.py ...`` (or ``python -m ...``) would have
them. The routing line (and flatzero's init report) go to stderr on rank 0 unless the
script configures logging itself.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys

__all__ = ["main"]

USAGE = """usage: python -m flatzero.run SCRIPT [ARGS ...]
       python -m flatzero.run -m MODULE [ARGS ...]

Runs SCRIPT (or MODULE) as __main__ with deepspeed.initialize routed through flatzero
(flatzero.patch_deepspeed()): ZeRO stage 1/2 runs on flatzero, everything else on DeepSpeed.
Launch it on every rank, e.g.: torchrun --nproc-per-node 8 -m flatzero.run train.py ARGS"""


class _UnlessConfigured(logging.Filter):
    """Pass records only while the root logger has no handler (the script configured none)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().handlers


def _show_flatzero_logs() -> None:
    flatzero_logger = logging.getLogger("flatzero")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[flatzero] %(message)s"))
    handler.addFilter(_UnlessConfigured())
    flatzero_logger.addHandler(handler)
    if flatzero_logger.level == logging.NOTSET:
        flatzero_logger.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> None:
    """Patch ``deepspeed.initialize`` and run the script (or ``-m`` module) in ``argv``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    module = None
    if argv[0] == "-m":
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            raise SystemExit(2)
        module, rest = argv[1], argv[2:]
    else:
        script, rest = argv[0], argv[1:]
        if not os.path.isfile(script):
            print(f"flatzero.run: no such script: {script!r}\n\n{USAGE}", file=sys.stderr)
            raise SystemExit(2)

    from .deepspeed.patch import patch_deepspeed

    _show_flatzero_logs()
    try:
        patch_deepspeed()
    except ModuleNotFoundError as error:
        print(f"flatzero.run: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    if module is not None:
        sys.argv = [module, *rest]  # run_module sets argv[0] to the module's file
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [script, *rest]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
