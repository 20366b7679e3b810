"""``torch.save``'s file format, written one tensor at a time.

``torch.save`` needs every tensor of the object at once (it pickles the object first and
then writes each storage). ``TorchZipWriter`` takes the object up front with
``StoredTensor`` placeholders (dtype and shape, no data), writes its pickle, and then
takes each placeholder's data when the caller has it in host memory. The result is the
zip file ``torch.save`` writes (the same records: ``data.pkl``, ``.format_version``,
``.storage_alignment``, ``byteorder``, ``data/<key>``, ``version``), read back by
``torch.load`` (``weights_only=True`` and ``mmap=True`` included) as contiguous CPU
tensors; a placeholder used under several keys loads as one tensor under all of them.

It uses what ``torch.serialization._save`` uses: ``torch._C.PyTorchFileWriter`` and
``torch._utils._rebuild_tensor_v2``.
"""

from __future__ import annotations

import io
import math
import pickle
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, BinaryIO

import torch

__all__ = ["StoredTensor", "TorchZipWriter", "storage_id"]

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


class TorchZipWriter:
    """Write ``obj`` in ``torch.save``'s format to ``file``, its tensors one by one.

    The constructor writes the pickle of ``obj``; then ``write`` every ``StoredTensor``
    in ``obj`` (each once, in any order) and call ``finish``, which checks that all were
    written and ends the zip file. ``file`` is the caller's to flush, fsync and close.

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
        self._zip = torch._C.PyTorchFileWriter(
            file, torch.serialization.get_crc32_options(), int(alignment)
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
