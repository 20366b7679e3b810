"""Writing the files of one checkpoint: rank files, the model's rest, no collectives.

``save.py`` calls these on every rank at once (each rank its own file); the DeepSpeed
importer calls them for every rank in turn from one process.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..dtypes import dtype_name
from ..storage.checksum import ChunkSums
from ..storage.header import TensorEntry
from ..storage.image import FileImage, write_image
from ..storage.writer import SafetensorsWriter
from .atomic import fault_point
from .format import FileRecord, rank_file_name

if TYPE_CHECKING:
    from tqdm import tqdm

__all__ = [
    "LazyTensor",
    "model_extras",
    "rank_file_metadata",
    "write_image_file",
    "write_rank_file",
    "write_tensors",
]


def _tensor_record(entry: TensorEntry, sums: ChunkSums | None) -> dict[str, Any]:
    """A tensor's record in ``meta.json``: dtype, shape and its chunked checksums."""
    record: dict[str, Any] = {"dtype": dtype_name(entry.dtype), "shape": list(entry.shape)}
    if sums is not None:
        record["checksum"] = sums.to_dict()
    return record


@dataclass(frozen=True)
class LazyTensor:
    """A tensor made only when its turn to be written comes (and dropped after), so that a
    file is written with one of its tensors in memory at a time.

    Attributes:
        dtype: the tensor's dtype.
        shape: its shape.
        make: returns the tensor (of that dtype and shape).
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]


def write_tensors(
    path: Path,
    tensors: Sequence[tuple[str, torch.Tensor | LazyTensor]],
    metadata: dict[str, str],
    *,
    checksums: bool,
    rank: int = -1,
    progress: tqdm | None = None,
) -> FileRecord:
    """Write ``tensors`` (in order) to a new safetensors file ``path`` and fsync it;
    ``progress`` advances by each tensor's bytes as it is written."""
    entries = [TensorEntry(n, t.dtype, tuple(t.shape)) for n, t in tensors]
    try:
        with SafetensorsWriter(path, entries, metadata, checksums=checksums) as writer:
            for name, item in tensors:
                tensor = item.make() if isinstance(item, LazyTensor) else item
                writer.write(name, tensor)
                fault_point("tensor_written", rank)
                if progress is not None:
                    progress.update(tensor.numel() * tensor.element_size())
                del tensor  # a LazyTensor's is gone before the next is made
    except OSError as error:  # os.write's ENOSPC names no file: name the one written
        if error.filename is not None or error.errno is None:
            raise
        raise OSError(error.errno, error.strerror, str(path)) from error
    return FileRecord(
        rank=rank,
        file=path.name,
        bytes=os.path.getsize(path),
        tensors={e.name: _tensor_record(e, writer.checksum[e.name]) for e in entries},
    )


def write_rank_file(
    directory: Path,
    rank: int,
    world_size: int,
    tensors: Sequence[tuple[str, torch.Tensor | LazyTensor]],
    *,
    layout_digest: str,
    tag: str,
    metadata: dict[str, str] | None = None,
    checksums: bool = True,
    progress: tqdm | None = None,
    nonce: str | None = None,
) -> FileRecord:
    """Write rank ``rank``'s file into ``directory`` (its name from ``rank_file_name``);
    ``progress`` advances by the bytes written.

    The file's metadata records the rank, world size, tag, layout digest and the save's
    ``nonce``, so a file that strayed from another checkpoint, or from another save of
    the same tag, is recognized on load.
    """
    meta = rank_file_metadata(rank, world_size, layout_digest, tag, metadata, nonce)
    path = directory / rank_file_name(rank, world_size)
    record = write_tensors(path, tensors, meta, checksums=checksums, rank=rank, progress=progress)
    fault_point("rank_file_written", rank)
    return record


def rank_file_metadata(
    rank: int,
    world_size: int,
    layout_digest: str,
    tag: str,
    metadata: dict[str, str] | None,
    nonce: str | None = None,
) -> dict[str, str]:
    """The header metadata of rank ``rank``'s file: its rank, world size, tag, layout
    digest and the save's ``nonce`` (when given; ``meta.json`` records the same), and
    ``metadata`` (RNG states)."""
    return {
        "format": "flatzero.rank/1",
        "rank": str(rank),
        "world_size": str(world_size),
        "tag": tag,
        "layout_digest": layout_digest,
        **({"nonce": nonce} if nonce is not None else {}),
        **(metadata or {}),
    }


def write_image_file(
    directory: Path,
    image: FileImage,
    *,
    sums: Callable[[], Mapping[str, ChunkSums | None]],
    rank: int = -1,
) -> FileRecord:
    """Write a snapshot's file (``image.write_image``: without the page cache where the
    system allows) into ``directory``; its record, as ``write_tensors`` returns it (with
    the same fault point after each tensor), with the checksums ``sums()`` gives once the
    file is written (computed by another thread meanwhile: ``async_save.Hasher``)."""
    size = write_image(directory, image, tensor_written=lambda: fault_point("tensor_written", rank))
    checksums = sums()
    return FileRecord(
        rank=rank,
        file=image.name,
        bytes=size,
        tensors={e.name: _tensor_record(e, checksums[e.name]) for e in image.entries},
    )


def model_extras(
    model: nn.Module, layout_names: dict[int, str]
) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, str]]:
    """What a checkpoint needs from the model besides the flattened params.

    Args:
        model: the model.
        layout_names: ``id(param) -> name in the layout`` of every flattened param.

    Returns:
        ``(rest, model_names, aliases)``: frozen (or not optimized) params and persistent
        buffers by name; layout name -> the model's name where they differ; second names of
        tied params -> the model name they are stored under.
    """
    rest: dict[str, torch.Tensor] = {}
    model_names: dict[str, str] = {}
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
            continue
        first[id(p)] = name
        layout_name = layout_names.get(id(p))
        if layout_name is None:
            rest[name] = p.detach()
        elif layout_name != name:
            model_names[layout_name] = name
    persistent = set(model.state_dict(keep_vars=True).keys())
    for name, b in model.named_buffers(remove_duplicate=False):
        if name in persistent and b is not None:
            rest[name] = b.detach()
    for name, t in rest.items():
        if t.is_meta:
            raise ValueError(
                f"{name} is on the meta device and has no values to save; materialize it, "
                "or save without model="
            )
    return rest, model_names, aliases
