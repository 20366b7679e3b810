"""DeepSpeed's pickled classes, read and written without DeepSpeed and without running code.

A DeepSpeed ZeRO-1/2 checkpoint (0.14 to 0.19) pickles tensors, containers, ``torch.Size``,
dtypes and four classes of its own: the loss scaler (``LossScaler`` or
``DynamicLossScaler``), the stage (``ZeroStageEnum``) and the fragment addresses of
``param_slice_mappings`` (``fragment_address``). ``load`` reads a ``.pt`` file with torch's
``weights_only`` unpickler, allowing those four and nothing else beyond torch's own safe
set, each as an inert record defined here; any other global in the pickle is refused
before it is looked up, with an error naming it, so nothing in the file runs.

``pickler`` writes the same records back under DeepSpeed's names (``GLOBAL`` opcodes, as
``torch.save`` under DeepSpeed writes them), so DeepSpeed's own ``torch.load`` builds its
real classes from a file flatzero wrote.
"""

from __future__ import annotations

import enum
import os
import pickle
import re
from typing import Any, ClassVar

import torch

from .torchzip import storage_id

__all__ = [
    "DEEPSPEED_CLASSES",
    "DynamicLossScaler",
    "FragmentAddress",
    "StaticLossScaler",
    "ZeroStage",
    "load",
    "pickler",
]


class _Record:
    """An inert stand-in for a DeepSpeed class: the attributes it was pickled with, no
    behaviour. Subclasses name the DeepSpeed class (``deepspeed_name``)."""

    deepspeed_name: ClassVar[str]

    def __init__(self, **attributes: Any) -> None:
        self.__dict__.update(attributes)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class StaticLossScaler(_Record):
    """DeepSpeed's ``LossScaler``: a fixed scale (1.0 in bf16 and fp32).

    Attributes (as pickled): ``cur_scale`` (the scale), ``dynamic`` (False).
    """

    deepspeed_name = "deepspeed.runtime.fp16.loss_scaler.LossScaler"


class DynamicLossScaler(_Record):
    """DeepSpeed's ``DynamicLossScaler`` (fp16).

    Attributes (as pickled): ``cur_scale``; ``cur_iter`` (optimizer steps taken, skipped
    ones included); ``last_overflow_iter`` (the step of the last overflow, -1 for none);
    ``scale_factor``; ``scale_window`` (clean steps between growths); ``min_scale``;
    ``delayed_shift`` (``fp16.hysteresis``); ``cur_hysteresis`` (overflows left before the
    next back-off); ``consecutive_hysteresis``; ``raise_error_at_min_scale``; ``dynamic``
    (True); ``dtype`` (``torch.float16``).
    """

    deepspeed_name = "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"


class FragmentAddress(_Record):
    """DeepSpeed's ``fragment_address``: where a param's fragment lies in a partition.

    Attributes (as pickled): ``numel`` (elements), ``start`` (element offset in the rank's
    fp32 partition).
    """

    deepspeed_name = "deepspeed.utils.tensor_fragment.fragment_address"


class ZeroStage(enum.IntEnum):
    """DeepSpeed's ``ZeroStageEnum`` (the ``zero_stage`` of an optimizer state)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


_ZERO_STAGE_NAME = "deepspeed.runtime.zero.config.ZeroStageEnum"

DEEPSPEED_CLASSES: dict[str, type] = {
    StaticLossScaler.deepspeed_name: StaticLossScaler,
    DynamicLossScaler.deepspeed_name: DynamicLossScaler,
    FragmentAddress.deepspeed_name: FragmentAddress,
    _ZERO_STAGE_NAME: ZeroStage,
}
"""Every DeepSpeed class a ZeRO-1/2 checkpoint of DeepSpeed 0.14-0.19 pickles, by its
dotted name, and the inert class that stands in for it."""

_NAMES = {cls: name for name, cls in DEEPSPEED_CLASSES.items()}

_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+) (?:was not an allowed global|whose module)")


def _describe(dotted: str) -> str:
    """A refused global's dotted name, with its module and name apart."""
    module, _, name = dotted.rpartition(".")
    return f"{dotted} (module {module!r}, name {name!r})"


def load(path: str | os.PathLike[str]) -> Any:
    """``torch.load`` a DeepSpeed ``.pt`` file (memory-mapped, on the CPU), its DeepSpeed
    classes as inert records, without running anything in it.

    Raises:
        ValueError: the pickle names a global that is neither torch's safe set nor one of
            ``DEEPSPEED_CLASSES`` (the error names its module and name; it was not
            imported, nothing was called), or the file is not a ``torch.save`` zip file.
    """
    allowed = [(cls, name) for name, cls in DEEPSPEED_CLASSES.items()]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as error:
        found = _REFUSED_GLOBAL.search(str(error))
        if found is None:
            raise ValueError(
                f"{os.fspath(path)} cannot be read safely as a DeepSpeed checkpoint file "
                f"({_first_line(error)}); it was not loaded and nothing in it ran"
            ) from None
        raise ValueError(
            f"{os.fspath(path)} pickles {_describe(found.group(1))}, which no "
            "DeepSpeed ZeRO-1/2 checkpoint holds: refused without importing or calling it, "
            "nothing in the file ran. Only tensors, containers and DeepSpeed's "
            + ", ".join(name.rsplit(".", 1)[1] for name in DEEPSPEED_CLASSES)
            + " are read; if you trust the file, load it with torch.load(weights_only=False) "
            "yourself"
        ) from None
    except Exception as error:
        raise ValueError(
            f"{os.fspath(path)} cannot be read as a DeepSpeed checkpoint file "
            f"({type(error).__name__}: {_first_line(error)}); it is damaged or not a "
            "torch.save file"
        ) from error


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


# ------------------------------------------------------------------------------ writing
class _DeepSpeedPickler(pickle._Pickler):
    """``torch.save``'s pickling (protocol 2, ``torchzip`` storages as persistent ids) that
    writes the records of this module under DeepSpeed's class names."""

    dispatch: ClassVar[dict[type, Any]] = dict(pickle._Pickler.dispatch)

    def persistent_id(self, obj: Any) -> Any:
        return storage_id(obj)

    def save_global(self, obj: Any, name: str | None = None) -> None:
        dotted = _NAMES.get(obj)
        if dotted is None:
            super().save_global(obj, name)
            return
        module, _, qualname = dotted.rpartition(".")
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)

    def _save_record(self, obj: _Record) -> None:
        """As ``object.__reduce_ex__(2)`` pickles an instance: ``cls.__new__`` then its
        ``__dict__``."""
        self.save(type(obj))
        self.save(())
        self.write(pickle.NEWOBJ)
        self.memoize(obj)
        self.save(dict(vars(obj)))
        self.write(pickle.BUILD)

    def _save_stage(self, obj: ZeroStage) -> None:
        """As ``Enum.__reduce_ex__`` pickles a member: ``ZeroStageEnum(value)``."""
        self.save(ZeroStage)
        self.save((int(obj),))
        self.write(pickle.REDUCE)
        self.memoize(obj)

    for _record in (StaticLossScaler, DynamicLossScaler, FragmentAddress):
        dispatch[_record] = _save_record
    dispatch[ZeroStage] = _save_stage
    del _record


def pickler(file: Any, protocol: int) -> pickle._Pickler:
    """A pickler for ``TorchZipWriter`` files that DeepSpeed loads (records as DeepSpeed's
    classes)."""
    return _DeepSpeedPickler(file, protocol=protocol)
