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
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..checkpoint.export import consolidated_state_dict
from ..checkpoint.format import META

__all__ = ["install", "is_flatzero_checkpoint"]

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
