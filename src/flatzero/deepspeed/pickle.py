"""``torch.save``'s zip format and DeepSpeed's pickled classes, without DeepSpeed.

``TorchZipWriter`` writes a ``torch.save`` file one tensor at a time (see the note beside
it); ``load`` reads a DeepSpeed ``.pt`` file running nothing in it, and ``pickler`` writes
DeepSpeed's classes back under their names (see the note beside ``_Record``).
"""

from __future__ import annotations

import contextlib
import enum
import io
import math
import os
import pickle
import re
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, BinaryIO, ClassVar

import torch

__all__ = [
    "DEEPSPEED_CLASSES",
    "DynamicLossScaler",
    "FragmentAddress",
    "StaticLossScaler",
    "StoredTensor",
    "TorchZipWriter",
    "ZeroStage",
    "load",
    "pickler",
    "storage_id",
]

# [Note: ``torch.save``'s file format, written one tensor at a time.
#
# ``torch.save`` needs every tensor of the object at once (it pickles the object first and
# then writes each storage). ``TorchZipWriter`` takes the object up front with
# ``StoredTensor`` placeholders (dtype and shape, no data), writes its pickle, and then
# takes each placeholder's data when the caller has it in host memory. The result is the
# zip file ``torch.save`` writes (the same records: ``data.pkl``, ``.format_version``,
# ``.storage_alignment``, ``byteorder``, ``data/<key>``, ``version``), read back by
# ``torch.load`` (``weights_only=True`` and ``mmap=True`` included) as contiguous CPU
# tensors; a placeholder used under several keys loads as one tensor under all of them.
#
# It uses what ``torch.serialization._save`` uses: ``torch._C.PyTorchFileWriter`` and
# ``torch._utils._rebuild_tensor_v2``.]
_PICKLE_PROTOCOL = 2
"""``torch.save``'s default pickle protocol."""


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides (in elements) of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class _StorageRef:
    """The storage of a ``StoredTensor`` while it is pickled (a persistent id)."""

    def __init__(self, tensor: StoredTensor) -> None:
        self.tensor = tensor


class StoredTensor:
    """A tensor of a ``TorchZipWriter`` file whose data are written later.

    Attributes:
        key: the name of its storage record (``data/<key>``); unique in a file.
        dtype: its dtype.
        shape: its shape.
    """

    __slots__ = ("dtype", "key", "shape")

    def __init__(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.key = key
        self.dtype = dtype
        self.shape = tuple(shape)

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of its data."""
        return self.numel * self.dtype.itemsize

    def __reduce_ex__(self, protocol: int) -> tuple[Any, tuple]:
        """Pickled as ``torch.save`` pickles a contiguous tensor with its own storage."""
        args = (_StorageRef(self), 0, self.shape, _contiguous_strides(self.shape), False)
        return torch._utils._rebuild_tensor_v2, (*args, OrderedDict())


def storage_id(obj: Any) -> tuple | None:
    """The persistent id ``torch.save`` gives the storage of a ``StoredTensor`` being
    pickled (a tuple naming its record), None for any other object: the
    ``persistent_id`` of every pickler of a ``TorchZipWriter`` file."""
    if not isinstance(obj, _StorageRef):
        return None
    tensor = obj.tensor
    storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[tensor.dtype])
    return ("storage", storage_type, tensor.key, "cpu", tensor.numel)


class _Pickler(pickle.Pickler):
    """Pickles storages as ``torch.save`` does: a persistent id naming their record."""

    def persistent_id(self, obj: Any) -> tuple | None:
        return storage_id(obj)


def _pickled(obj: Any, pickler: Callable[..., Any]) -> bytes:
    """``obj`` pickled as ``torch.save`` pickles it, ``StoredTensor``s as tensors."""
    buffer = io.BytesIO()
    pickler(buffer, protocol=_PICKLE_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _own_storage(data: torch.Tensor) -> torch.UntypedStorage:
    """The bytes of the contiguous host tensor ``data`` as a storage that starts at its
    first byte, without a copy (a record is written from the start of a storage)."""
    storage = data.untyped_storage()
    if data.storage_offset() == 0 and storage.nbytes() == data.nbytes:
        return storage
    view = memoryview(data.reshape(-1).view(torch.uint8).numpy())
    return torch.frombuffer(view, dtype=torch.uint8).untyped_storage()


class _Sink:
    """The zip writer's file. After a failed write, or once the writer is abandoned, writes
    are dropped: torch's ``PyTorchFileWriter`` ends the zip in its destructor, and a short
    or failing write there aborts the whole process (``std::terminate``), where a full disk
    must only fail the save."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self.dropping = False

    def write(self, data: Any) -> int:
        if self.dropping:
            return memoryview(data).nbytes
        try:
            return self._file.write(data)
        except BaseException:
            self.dropping = True
            raise


class TorchZipWriter:
    """Write ``obj`` in ``torch.save``'s format to ``file``, its tensors one by one.

    Use it as a context manager. The constructor writes the pickle of ``obj``; then
    ``write`` every ``StoredTensor`` in ``obj`` (each once, in any order) and call
    ``finish``, which checks that all were written and ends the zip file. Leaving the
    ``with`` block on an error abandons the file (nothing more is written to it). ``file``
    is the caller's to flush, fsync and close (after the block).

    Args:
        file: a binary file opened for writing.
        obj: the object to save (a state dict), with ``StoredTensor``s for its tensors.
        tensors: every ``StoredTensor`` in ``obj``.
        pickler: ``pickler(buffer, protocol=...)`` makes the pickler of ``obj``; its
            ``persistent_id`` must be ``storage_id`` (default: ``torch.save``'s pickler).
    """

    def __init__(
        self,
        file: BinaryIO,
        obj: Any,
        tensors: list[StoredTensor],
        pickler: Callable[..., Any] = _Pickler,
    ) -> None:
        alignment = str(torch.serialization._get_storage_alignment())
        self._sink = _Sink(file)
        self._zip = torch._C.PyTorchFileWriter(
            self._sink, torch.serialization.get_crc32_options(), int(alignment)
        )
        self._todo = {t.key: t for t in tensors}
        data = _pickled(obj, pickler)
        self._zip.write_record("data.pkl", data, len(data))
        for name, text in (
            (".format_version", "1"),
            (".storage_alignment", alignment),
            ("byteorder", sys.byteorder),
        ):
            self._zip.write_record(name, text, len(text))

    def write(self, tensor: StoredTensor, data: torch.Tensor) -> None:
        """Write the data of ``tensor``: ``data``, a contiguous host tensor of its dtype
        and shape (the bytes are written from where they are)."""
        if self._todo.pop(tensor.key, None) is not tensor:
            raise ValueError(f"tensor {tensor.key!r} is not a pending tensor of this file")
        assert data.device.type == "cpu" and data.is_contiguous()
        assert data.dtype == tensor.dtype and tuple(data.shape) == tensor.shape
        name = f"data/{tensor.key}"
        if tensor.nbytes == 0:
            self._zip.write_record(name, b"", 0)
        else:
            self._zip.write_record(name, _own_storage(data), tensor.nbytes)

    def finish(self) -> None:
        """End the file; ``ValueError`` if a tensor was never written."""
        if self._todo:
            raise ValueError(f"tensors {sorted(self._todo)} were never written")
        self._zip.write_end_of_file()

    def __enter__(self) -> TorchZipWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self._sink.dropping = True
            # Ended here, its error caught: torch marks the writer finalized even when ending
            # fails, so its destructor does not try again (and abort the process).
            with contextlib.suppress(RuntimeError, OSError):
                self._zip.write_end_of_file()
        del self._zip


# [Note: DeepSpeed's pickled classes, read and written without DeepSpeed and without running code.
#
# A DeepSpeed ZeRO-1/2 checkpoint (0.14 to 0.19) pickles tensors, containers, ``torch.Size``,
# dtypes and four classes of its own: the loss scaler (``LossScaler`` or
# ``DynamicLossScaler``), the stage (``ZeroStageEnum``) and the fragment addresses of
# ``param_slice_mappings`` (``fragment_address``). ``load`` reads a ``.pt`` file with torch's
# ``weights_only`` unpickler, allowing those four and nothing else beyond torch's own safe
# set, each as an inert record defined here; any other global in the pickle is refused
# before it is looked up, with an error naming it, so nothing in the file runs.
#
# ``pickler`` writes the same records back under DeepSpeed's names (``GLOBAL`` opcodes, as
# ``torch.save`` under DeepSpeed writes them), so DeepSpeed's own ``torch.load`` builds its
# real classes from a file flatzero wrote.]
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
    """``torch.save``'s pickling (protocol 2, ``TorchZipWriter`` storages as persistent ids) that
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
