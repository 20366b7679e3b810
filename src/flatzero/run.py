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

On a machine without an accelerator, launched as one of several ranks, it also makes the
launch one job (``_one_job_without_accelerator``): ``DS_ACCELERATOR=cpu`` unless set, and
Accelerate's DeepSpeed path gets the gloo backend.
"""

from __future__ import annotations

import importlib.util
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


def _one_job_without_accelerator() -> None:
    """Under a launcher (``LOCAL_RANK`` set, ``WORLD_SIZE`` > 1) on a machine without an
    accelerator: ``DS_ACCELERATOR=cpu`` unless set, and Accelerate's DeepSpeed path gets gloo.

    [Note: Accelerate and the CPU] ``PartialState`` picks a process-group backend only for an
    accelerator (or ``cpu=True``, which turns DeepSpeed off). Without one it picks none and
    calls the world 1 rank, so the Trainer sizes ``train_batch_size`` for one rank while
    DeepSpeed (or flatzero) sees the launcher's world and refuses the batch sizes, or each
    rank trains alone. Where Accelerate chooses no backend for its DeepSpeed path
    (``ACCELERATE_USE_DEEPSPEED``, which ``--deepspeed``, ``accelerate launch --use_deepspeed``
    and a ``DeepSpeedPlugin`` set), gloo is chosen instead; every other choice stands. The
    same two settings are what a script run without ``flatzero.run`` needs on a CPU.
    """
    if "LOCAL_RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    from .accel import accelerator_type

    if accelerator_type() is not None:
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if importlib.util.find_spec("accelerate") is None:
        return
    from accelerate.state import PartialState

    choose = PartialState._prepare_backend

    def gloo_for_deepspeed(
        self: PartialState,
        cpu: bool = False,
        sagemaker_dp: bool = False,
        backend: str | None = None,
    ) -> tuple[str | None, object]:
        chosen, kind = choose(self, cpu, sagemaker_dp, backend)
        deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        return ("gloo" if chosen is None and deepspeed and not cpu else chosen), kind

    PartialState._prepare_backend = gloo_for_deepspeed


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
    _one_job_without_accelerator()
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
