"""DeepSpeed's ``zero_to_fp32`` functions reading flatzero's checkpoints (under the patch).

After training through ``patch_deepspeed()``, ``engine.save_checkpoint(dir)`` writes
flatzero's format (``dir/latest``, ``dir/<tag>/meta.json`` and safetensors shards), not
DeepSpeed's ``*_model_states.pt`` / ``*_optim_states.pt``. Hugging Face's and DeepSpeed's docs
tell users to consolidate with ``deepspeed.utils.zero_to_fp32``
(``get_fp32_state_dict_from_zero_checkpoint``, ``load_state_dict_from_zero_checkpoint``,
``convert_zero_checkpoint_to_fp32_state_dict``, ...). Each of them resolves the tag
(``tag=`` or the ``latest`` file) and then calls the module's
``_get_fp32_state_dict_from_zero_checkpoint(tag_dir, exclude_frozen_parameters)``.
``install()`` wraps that one function: a tag directory holding flatzero's ``meta.json``
is consolidated by ``flatzero.checkpoint.export.consolidated_state_dict`` (the trained
params in fp32 from the masters, frozen params and buffers as saved, tied names too, the
model's names); any other directory goes to DeepSpeed's function unchanged. Wrapping the
inner function, looked up at call time, covers the public functions even where a script
imported them before the patch. The wrapper stays after ``DeepSpeedPatch.undo()`` (as the
``safe_get_full_*`` ones do): DeepSpeed's checkpoints read as before.

As DeepSpeed's engine copies its ``zero_to_fp32.py`` beside every checkpoint, the door's
``save_checkpoint`` writes ``SCRIPT`` there (``write_script``): it takes DeepSpeed's
arguments (``python zero_to_fp32.py . OUTPUT_DIR``, as Hugging Face's docs run it) and runs
``main``: DeepSpeed's own conversion, with ``install()`` applied.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..checkpoint.export import consolidated_state_dict
from ..checkpoint.format import META

__all__ = [
    "SCRIPT",
    "install",
    "is_flatzero_checkpoint",
    "is_flatzero_script",
    "main",
    "write_script",
]

logger = logging.getLogger(__name__)

_INNER = "_get_fp32_state_dict_from_zero_checkpoint"
"""The function of ``deepspeed.utils.zero_to_fp32`` every public one calls with the tag's
directory (DeepSpeed 0.10 to 0.19)."""

_MARK = "__flatzero_zero_to_fp32__"


def is_flatzero_checkpoint(tag_dir: str | Path) -> bool:
    """Whether ``tag_dir`` is one of flatzero's checkpoints (it holds ``meta.json``)."""
    return (Path(tag_dir) / META).is_file()


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def read(ds_checkpoint_dir: Any, exclude_frozen_parameters: bool = False) -> dict[str, Any]:
        if not is_flatzero_checkpoint(ds_checkpoint_dir):
            return original(ds_checkpoint_dir, exclude_frozen_parameters)
        # [Note: frozen params] flatzero's model_rest holds frozen params and buffers
        # together (one file, nothing tells them apart); excluding frozen params drops both.
        logger.info("consolidating flatzero checkpoint %s (fp32 masters)", ds_checkpoint_dir)
        return consolidated_state_dict(
            ds_checkpoint_dir, include_rest=not exclude_frozen_parameters
        )

    setattr(read, _MARK, True)
    return read


def install() -> bool:
    """Wrap ``deepspeed.utils.zero_to_fp32._get_fp32_state_dict_from_zero_checkpoint`` (once;
    see the module docstring). False when that module or function is missing (nothing
    replaced)."""
    try:
        module = importlib.import_module("deepspeed.utils.zero_to_fp32")
    except Exception:  # no (or a broken) DeepSpeed: nothing calls its functions
        return False
    original = getattr(module, _INNER, None)
    if original is None:
        return False
    if not getattr(original, _MARK, False):
        setattr(module, _INNER, _wrap(original))
    return True


SCRIPT_NAME = "zero_to_fp32.py"
"""The script's name beside the checkpoints (DeepSpeed's)."""

SCRIPT = """#!/usr/bin/env python
# Written by flatzero's engine.save_checkpoint in place of DeepSpeed's zero_to_fp32.py: the
# checkpoints here are flatzero's. DeepSpeed's arguments: python zero_to_fp32.py CHECKPOINT_DIR
# OUTPUT_DIR [--max_shard_size 5GB] [--safe_serialization] [-t TAG] [--exclude_frozen_parameters].
# Needs flatzero and DeepSpeed installed; without DeepSpeed: flatzero export CHECKPOINT_DIR OUT.
import sys

from flatzero.deepspeed.zero_to_fp32 import main

if __name__ == "__main__":
    sys.exit(main())
"""
"""The ``zero_to_fp32.py`` the door writes beside its checkpoints."""


def is_flatzero_script(path: Path) -> bool:
    """Whether ``path`` is the ``zero_to_fp32.py`` the door wrote (not DeepSpeed's)."""
    try:
        return path.name == SCRIPT_NAME and path.read_text(encoding="utf-8") == SCRIPT
    except (OSError, UnicodeDecodeError):
        return False


def write_script(save_dir: str | Path) -> None:
    """Write ``SCRIPT`` as ``save_dir/zero_to_fp32.py`` (executable; through a temporary
    name, so a reader never sees half of it). An error is logged, not raised: the
    checkpoint itself is saved."""
    path = Path(save_dir) / SCRIPT_NAME
    tmp = path.with_name(f".tmp-{SCRIPT_NAME}-{os.getpid()}")
    try:
        tmp.write_text(SCRIPT, encoding="utf-8")
        tmp.chmod(0o755)
        os.replace(tmp, path)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        logger.warning("flatzero: could not write %s: %s", path, error)


def main(argv: list[str] | None = None) -> int:
    """``zero_to_fp32.py``'s command line, DeepSpeed's arguments: DeepSpeed's
    ``convert_zero_checkpoint_to_fp32_state_dict`` with ``install()`` applied."""
    parser = argparse.ArgumentParser(description="consolidate a ZeRO checkpoint into fp32")
    parser.add_argument("checkpoint_dir", help="the checkpoint folder, e.g. path/checkpoint-12")
    parser.add_argument("output_dir", help="where the fp32 state_dict files go")
    parser.add_argument("--max_shard_size", default="5GB", help="e.g. 5GB")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag, e.g. global_step1")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true", help="ignored (DeepSpeed's)")
    args = parser.parse_args(argv)
    if not install():
        parser.error(
            "DeepSpeed's deepspeed.utils.zero_to_fp32 cannot be imported (pip install "
            "deepspeed); or run: flatzero export CHECKPOINT_DIR OUT --dtype fp32"
        )
    module = importlib.import_module("deepspeed.utils.zero_to_fp32")
    module.convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir,
        args.output_dir,
        max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization,
        tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters,
    )
    return 0
