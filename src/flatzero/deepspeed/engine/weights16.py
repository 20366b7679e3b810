"""The model's weights in one file, written from the flat buffers (``save_16bit_model``)."""

from __future__ import annotations

import bisect
import contextlib
import logging
import math
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...checkpoint.atomic import fsync_dir
from ...checkpoint.format import TMP_PREFIX
from ...flatten.buffers import shaped_view
from ...storage.header import TensorEntry
from ...storage.writer import SafetensorsWriter
from ..pickle import StoredTensor, TorchZipWriter

__all__ = [
    "WeightBlock",
    "WeightTensor",
    "WeightsPlan",
    "plan_weights",
    "state_nbytes",
    "write_weights",
]

logger = logging.getLogger(__name__)

_SAFETENSORS_METADATA = {"format": "pt"}
"""The metadata transformers writes into a safetensors weights file."""


@dataclass(frozen=True)
class WeightTensor:
    """One tensor of the file.

    Attributes:
        keys: the state-dict keys it is saved under, in state-dict order (several for
            tied weights).
        dtype: its dtype.
        shape: its shape.
        offset: where its data start in its block's source, in elements.
    """

    keys: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        """Bytes of its data."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class WeightBlock:
    """Memory that goes to the host in one copy.

    Attributes:
        source: a bucket buffer (1-D), or one tensor outside the buckets.
        tensors: the file's tensors that lie in it, by offset.
    """

    source: torch.Tensor
    tensors: tuple[WeightTensor, ...]

    @property
    def nbytes(self) -> int:
        """Bytes a host copy of the block takes."""
        return self.source.numel() * self.source.element_size()


@dataclass(frozen=True)
class WeightsPlan:
    """What a weights file holds and where each tensor's data are.

    Attributes:
        keys: every key of the state dict, in its order.
        blocks: the blocks, in the order they are written (buckets first).
        objects: the state dict's values that are not tensors (``torch.save`` format
            only), by key.
        metadata: the state dict's ``_metadata`` (module versions), or None.
    """

    keys: tuple[str, ...]
    blocks: tuple[WeightBlock, ...]
    objects: dict[str, Any]
    metadata: Any

    @property
    def tensors(self) -> list[WeightTensor]:
        """Every tensor of the file, in the order they are written."""
        return [t for block in self.blocks for t in block.tensors]

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in the file (each tied tensor once)."""
        return sum(t.nbytes for t in self.tensors)


class _BucketFinder:
    """Which bucket a tensor's memory lies in, by address."""

    def __init__(self, buckets: Sequence[torch.Tensor]) -> None:
        self._spans: dict[tuple[torch.device, torch.dtype], list[tuple[int, int, int]]] = {}
        for index, bucket in enumerate(buckets):
            assert bucket.dim() == 1 and bucket.is_contiguous()
            start = bucket.data_ptr()
            key = (bucket.device, bucket.dtype)
            self._spans.setdefault(key, []).append((start, start + bucket.nbytes, index))
        for spans in self._spans.values():
            spans.sort()

    def find(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """``(bucket index, element offset)`` of a contiguous ``tensor`` that lies inside
        a bucket of its dtype; None for any other tensor."""
        spans = self._spans.get((tensor.device, tensor.dtype))
        if not spans or tensor.numel() == 0 or not tensor.is_contiguous():
            return None
        address = tensor.data_ptr()
        j = bisect.bisect_right(spans, (address, math.inf, math.inf)) - 1
        if j < 0:
            return None
        start, end, index = spans[j]
        if address + tensor.nbytes > end:
            return None
        return index, (address - start) // tensor.element_size()


def _identity(tensor: torch.Tensor) -> tuple:
    """Tensors with the same identity are the same data (tied weights)."""
    return (
        tensor.device,
        tensor.data_ptr(),
        tensor.dtype,
        tuple(tensor.shape),
        tensor.stride(),
    )


def _unique_tensors(
    state: Mapping[str, Any],
) -> tuple[dict[tuple, tuple[torch.Tensor, list[str]]], dict[str, Any]]:
    """The state dict's distinct tensors with their keys, and its other values."""
    unique: dict[tuple, tuple[torch.Tensor, list[str]]] = {}
    objects: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            objects[key] = value
            continue
        if value.is_meta:
            raise ValueError(
                f"{key} is on the meta device and has no values to save; materialize it, "
                "or leave it out of the state dict"
            )
        unique.setdefault(_identity(value), (value.detach(), []))[1].append(key)
    return unique, objects


def plan_weights(state: Mapping[str, Any], buckets: Sequence[torch.Tensor]) -> WeightsPlan:
    """Plan writing ``state`` (a ``state_dict``): its tensors that are views of
    ``buckets`` are read through their bucket, the others one by one.

    Pure bookkeeping: no copy, no collective.

    Args:
        state: the state dict to save (its tensors are not copied).
        buckets: the flat buckets (1-D contiguous buffers) the params are views of.

    Raises:
        ValueError: a tensor of ``state`` is on the meta device.
    """
    finder = _BucketFinder(buckets)
    unique, objects = _unique_tensors(state)
    in_buckets: dict[int, list[WeightTensor]] = {}
    alone: list[WeightBlock] = []
    for tensor, keys in unique.values():
        found = finder.find(tensor)
        shape = tuple(tensor.shape)
        if found is None:
            entry = WeightTensor(tuple(keys), tensor.dtype, shape, 0)
            alone.append(WeightBlock(tensor, (entry,)))
        else:
            index, offset = found
            entry = WeightTensor(tuple(keys), tensor.dtype, shape, offset)
            in_buckets.setdefault(index, []).append(entry)
    blocks = [
        WeightBlock(buckets[i], tuple(sorted(entries, key=lambda e: e.offset)))
        for i, entries in sorted(in_buckets.items())
    ]
    return WeightsPlan(
        keys=tuple(state.keys()),
        blocks=tuple(blocks + alone),
        objects=objects,
        metadata=getattr(state, "_metadata", None),
    )


def state_nbytes(state: Mapping[str, Any]) -> int:
    """Bytes of the tensors of ``state`` (tied ones counted per key): an upper bound of
    what ``write_weights`` writes, for timeouts."""
    return sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))


def _in_host_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` can be written without a copy to the host."""
    return tensor.device.type == "cpu"


def _staging_nbytes(plan: WeightsPlan) -> int:
    """Bytes of the host buffer the blocks outside host memory are copied into: the
    largest of them (0 when every block is in host memory)."""
    return max((b.nbytes for b in plan.blocks if not _in_host_memory(b.source)), default=0)


def _copy_to_host(source: torch.Tensor, staging: torch.Tensor) -> torch.Tensor:
    """``source``'s values in the first bytes of the host buffer ``staging`` (uint8), as a
    contiguous tensor of ``source``'s dtype and shape."""
    nbytes = source.numel() * source.element_size()
    host = staging[:nbytes].view(source.dtype).view(source.shape)
    host.copy_(source)
    return host


def _each_host_tensor(
    plan: WeightsPlan, write: Callable[[WeightTensor, torch.Tensor], None]
) -> None:
    """Call ``write(tensor, data)`` for every tensor of ``plan`` with its data in host
    memory (contiguous), block by block. A block in host memory is read where it is;
    any other is copied into one host buffer, allocated once with the size of the largest
    such block and reused by every block."""
    size = _staging_nbytes(plan)
    staging = torch.empty(size, dtype=torch.uint8) if size else None
    for block in plan.blocks:
        if _in_host_memory(block.source):
            host = block.source.contiguous().reshape(-1)
        else:
            assert staging is not None
            host = _copy_to_host(block.source, staging).reshape(-1)
        for tensor in block.tensors:
            write(tensor, shaped_view(host, tensor.offset, tensor.shape))


def _write_safetensors(path: Path, plan: WeightsPlan) -> None:
    """Write ``plan`` as a safetensors file at ``path`` (created; fsynced)."""
    if plan.objects:
        raise TypeError(
            f"the state dict holds values that are not tensors ({sorted(plan.objects)}); "
            "safetensors stores tensors only: save under a name that does not end with "
            ".safetensors (torch.save format)"
        )
    entries = [TensorEntry(k, t.dtype, t.shape) for t in plan.tensors for k in t.keys]

    with SafetensorsWriter(path, entries, _SAFETENSORS_METADATA, checksums=False) as writer:

        def write(tensor: WeightTensor, data: torch.Tensor) -> None:
            for key in tensor.keys:
                writer.write(key, data)

        _each_host_tensor(plan, write)


def _torch_state(plan: WeightsPlan) -> tuple[OrderedDict, dict[WeightTensor, StoredTensor]]:
    """The state dict ``torch.save`` would get, with placeholders for the tensors."""
    stored = {t: StoredTensor(str(i), t.dtype, t.shape) for i, t in enumerate(plan.tensors)}
    by_key = {k: stored[t] for t in plan.tensors for k in t.keys}
    state = OrderedDict((k, by_key[k] if k in by_key else plan.objects[k]) for k in plan.keys)
    if plan.metadata is not None:
        state._metadata = plan.metadata  # type: ignore[attr-defined]
    return state, stored


def _write_torch_save(path: Path, plan: WeightsPlan) -> None:
    """Write ``plan`` in ``torch.save``'s format at ``path`` (created; fsynced)."""
    state, stored = _torch_state(plan)
    with open(path, "xb") as file:
        with TorchZipWriter(file, state, list(stored.values())) as writer:
            _each_host_tensor(plan, lambda tensor, data: writer.write(stored[tensor], data))
            writer.finish()
        file.flush()
        os.fsync(file.fileno())


def _tmp_path(path: Path) -> Path:
    """A new temporary name next to ``path``."""
    return path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}-{secrets.token_hex(4)}")


def _reason(error: OSError) -> str:
    """What went wrong, with the file it went wrong on."""
    return f"{error.strerror} ({error.filename})" if error.filename else str(error.strerror)


# [Note: how the file is written.
# ZeRO stages 1 and 2 keep every trainable param, in the training dtype, in full on every
# rank: the flat buckets are all-gathered at the end of init, of every optimizer step and
# of every load. So one rank writes the file from its own memory, with no collective.
#
# The file is written block by block. A block is one bucket (every param in it, one
# device-to-host copy) or one tensor outside the buckets (a frozen param, a buffer). A
# block in device memory is copied into a host buffer and its tensors are written from
# there; the buffer is allocated once, as large as the largest such block, and reused by
# every block. That buffer is the extra host memory of a save, and nothing is allocated on
# the device (a non-contiguous tensor outside the buckets excepted: ``copy_`` makes it
# contiguous on its device first). Blocks in host memory (the cpu tier) are written from
# where they are: no copy (a non-contiguous tensor outside the buckets excepted).
#
# The file appears only complete: it is written under a temporary name
# (``.tmp-<name>-<pid>-<random>``) in the same directory, fsynced, and renamed over the
# final name; on an error the temporary file is removed.
#
# Its format follows the file name: ``*.safetensors`` is safetensors (metadata
# ``{"format": "pt"}``, as transformers writes it), anything else ``torch.save``'s zip
# format (``flatzero.deepspeed.pickle``). The keys are those of the state dict, in its order;
# tied weights are one tensor under all their keys (``torch.save``: one storage;
# safetensors: the bytes once per key, since the format cannot alias).]
def write_weights(path: str | os.PathLike[str], plan: WeightsPlan) -> None:
    """Write the file ``plan`` describes to ``path``: complete, or not at all.

    ``path`` (and its directory, created if needed) ends up holding the whole new file
    (an existing file is replaced) or, after an error or a crash, what it held before.
    Runs on one process; no collective.

    Raises:
        OSError: the directory or file cannot be written (its message names ``path``).
        TypeError: a ``.safetensors`` name for a state dict with non-tensor values.
    """
    path = Path(path)
    start = time.perf_counter()
    tmp = _tmp_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".safetensors":
            _write_safetensors(tmp, plan)
        else:
            _write_torch_save(tmp, plan)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as error:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(error, OSError) and error.errno is not None:
            raise OSError(error.errno, f"cannot write {path}: {_reason(error)}") from error
        raise
    logger.info(
        "wrote %s: %d keys, %.1f MiB in %.2f s (host copy buffer %.1f MiB)",
        path,
        len(plan.keys),
        plan.nbytes / 2**20,
        time.perf_counter() - start,
        _staging_nbytes(plan) / 2**20,
    )
