"""``flatzero export``: a checkpoint's consolidated weights as safetensors keyed by name.

The output is what HF transformers writes (``save_pretrained``): one ``model.safetensors``,
or ``model-00001-of-0000N.safetensors`` files of bounded size plus
``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map":
{name: file}}``), every file with ``{"format": "pt"}`` metadata. It loads with
``model.load_state_dict(safetensors.torch.load_file(...))`` and with transformers'
``from_pretrained`` (next to the model's ``config.json``).

Export runs in one process and never holds more than one param in memory: each param
is assembled from the slices of the rank files that hold it (memory-mapped), cast, and
streamed into its output file.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..dtypes import SAFETENSORS_DTYPES, SHORT_DTYPES
from ..progress import progress_bar
from ..storage.header import TensorEntry
from ..storage.tensorfile import open_safetensors
from ..storage.writer import SafetensorsWriter
from .config import ExportConfig
from .format import MASTER
from .reader import CheckpointReader

if TYPE_CHECKING:
    from tqdm import tqdm

__all__ = [
    "INDEX_NAME",
    "ExportResult",
    "consolidated_state_dict",
    "export_checkpoint",
    "export_main",
]

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
"""Name of the index of a sharded export (as HF transformers names it)."""

SINGLE_NAME = "model.safetensors"
"""Name of an export that fits one file."""


@dataclass(frozen=True)
class ExportResult:
    """What ``export_checkpoint`` wrote.

    Attributes:
        out_dir: the output directory.
        files: the safetensors files written, in order.
        index: the index file, or None for a single file.
        tensors: number of tensors written.
        total_bytes: bytes of tensor data written.
        seconds: wall-clock seconds.
    """

    out_dir: Path
    files: tuple[str, ...]
    index: str | None
    tensors: int
    total_bytes: int
    seconds: float


@dataclass(frozen=True)
class _Item:
    name: str  # output name
    source: str  # "param" | "rest"
    key: str  # name in the checkpoint (layout name or rest key)
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _items(reader: CheckpointReader, config: ExportConfig) -> list[_Item]:
    meta = reader.meta
    items: list[_Item] = []
    slots = [(g.group_index, s.registration_index, s) for g in meta.layout.groups for s in g.slots]
    for _, _, slot in sorted(slots, key=lambda t: (t[0], t[1])):
        saved = getattr(torch, slot.spec.dtype)
        dtype = saved if config.dtype == "saved" else SHORT_DTYPES[config.dtype]
        out = meta.model_names.get(slot.spec.name, slot.spec.name)
        items.append(_Item(out, "param", slot.spec.name, dtype, slot.spec.shape))
    if config.include_rest and meta.model_rest is not None:
        handle = open_safetensors(reader.path / meta.model_rest)
        for key in list(handle.keys()):
            piece = handle.get_slice(key)
            saved = SAFETENSORS_DTYPES[piece.get_dtype()]
            dtype = saved
            if config.dtype != "saved" and saved.is_floating_point:
                dtype = SHORT_DTYPES[config.dtype]
            items.append(_Item(key, "rest", key, dtype, tuple(piece.get_shape())))
    if config.include_tied:
        by_name = {i.name: i for i in items}
        for alias, target in sorted(meta.aliases.items()):
            if target in by_name and alias not in by_name:
                t = by_name[target]
                items.append(_Item(alias, t.source, t.key, t.dtype, t.shape))
    names = [i.name for i in items]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"{reader.path}: export names {dup[:4]} appear twice")
    return items


def _shard(items: list[_Item], max_bytes: int) -> list[list[_Item]]:
    files: list[list[_Item]] = [[]]
    size = 0
    for item in items:
        if files[-1] and size + item.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(item)
        size += item.nbytes
    return files


def export_checkpoint(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    config: ExportConfig | None = None,
    overwrite: bool = False,
    verify: bool = False,
    progress: bool = True,
) -> ExportResult:
    """Write the consolidated weights of a checkpoint as HF-style safetensors.

    Args:
        checkpoint: a checkpoint directory (``latest`` is followed) or a checkpoint.
        out_dir: where to write (created if needed; other files there are kept, e.g. a
            ``config.json``).
        tag: which checkpoint; ``None`` follows ``latest``.
        config: dtype, file size bound, tied names, frozen params and buffers.
        overwrite: replace existing ``model*.safetensors`` / index files in ``out_dir``.
        verify: check the checksums of the rank files first.
        progress: a bar of the bytes written on stderr, where ``flatzero.progress`` shows
            one (a terminal; ``FLATZERO_PROGRESS``).

    Returns:
        ``ExportResult`` naming the files.

    Raises:
        ValueError: a damaged checkpoint, or output files that exist (without
            ``overwrite``); nothing is written then.
    """
    config = config or ExportConfig()
    t0 = time.perf_counter()
    out = Path(out_dir)
    with CheckpointReader(checkpoint, tag) as reader:
        if verify:
            reader.verify()
        items = _items(reader, config)
        groups = _shard(items, config.max_shard_bytes)
        n = len(groups)
        names = (
            [SINGLE_NAME]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        _clear_outputs(out, overwrite)
        weight_map: dict[str, str] = {}
        total = sum(item.nbytes for item in items)
        with progress_bar(total, "export", "B", wanted=progress, scale=True) as bar:
            for file_name, group in zip(names, groups, strict=True):
                _write_file(reader, out, file_name, group, bar)
                weight_map.update({item.name: file_name for item in group})
        index = None
        if n > 1:
            index = INDEX_NAME
            text = json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2
            )
            (out / INDEX_NAME).write_text(text + "\n", encoding="utf-8")
    result = ExportResult(out, tuple(names), index, len(items), total, time.perf_counter() - t0)
    logger.info(
        "exported %d tensors (%.1f MiB) of %s into %d file(s) in %s",
        result.tensors,
        total / 2**20,
        reader.path,
        n,
        out,
    )
    return result


def _clear_outputs(out: Path, overwrite: bool) -> None:
    """Create ``out``; remove an earlier export there, or refuse without ``overwrite``."""
    out.mkdir(parents=True, exist_ok=True)
    existing = [
        p.name
        for p in out.iterdir()
        if re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?", p.name)
    ]
    if existing and not overwrite:
        raise ValueError(
            f"{out} already holds {sorted(existing)[:3]}; choose another directory or "
            "pass overwrite=True (--overwrite)"
        )
    for name in existing:
        (out / name).unlink()


def _write_file(
    reader: CheckpointReader, out: Path, file_name: str, group: list[_Item], progress: tqdm
) -> None:
    """Write ``group``'s tensors, one at a time, into ``out/file_name`` (via a temporary
    name); ``progress`` advances by each one's bytes."""
    rest = _open_rest(reader)
    tmp = out / f".tmp-{file_name}"
    tmp.unlink(missing_ok=True)
    entries = [TensorEntry(i.name, i.dtype, i.shape) for i in group]
    metadata = {"format": "pt", "source": f"flatzero checkpoint {reader.tag}"}
    with SafetensorsWriter(tmp, entries, metadata, checksums=False) as writer:
        for item in group:
            writer.write(item.name, _read_item(reader, rest, item))
            progress.update(item.nbytes)
    os.replace(tmp, out / file_name)


def _open_rest(reader: CheckpointReader) -> Any:
    """``model_rest.safetensors`` opened, or None when the checkpoint has none."""
    if reader.meta.model_rest is None:
        return None
    return open_safetensors(reader.path / reader.meta.model_rest)


def _read_item(reader: CheckpointReader, rest: Any, item: _Item) -> torch.Tensor:
    """``item``'s consolidated tensor in its output dtype (a param from the fp32 masters)."""
    if item.source == "param":
        tensor = reader.read_param(item.key, MASTER)
    else:
        assert rest is not None
        tensor = rest.get_tensor(item.key)
    return tensor.to(item.dtype).contiguous()


def consolidated_state_dict(
    checkpoint: str | os.PathLike[str], *, tag: str | None = None, include_rest: bool = True
) -> dict[str, torch.Tensor]:
    """A checkpoint's consolidated weights in memory, as DeepSpeed's ``zero_to_fp32``
    returns them: every trained param in fp32 from the masters, the frozen params and
    buffers saved with the checkpoint in their saved dtype, tied params under both names
    (one tensor), keyed by the model's names, on the host.

    Args:
        checkpoint: a checkpoint directory (``latest`` is followed) or a checkpoint.
        tag: which checkpoint; ``None`` follows ``latest``.
        include_rest: also return the frozen params and buffers (``model_rest``).

    Raises:
        CheckpointDamaged: no such checkpoint, or a damaged one.
    """
    config = ExportConfig(dtype="saved", include_tied=True, include_rest=include_rest)
    out: dict[str, torch.Tensor] = {}
    with CheckpointReader(checkpoint, tag) as reader:
        rest = _open_rest(reader)
        by_key: dict[tuple[str, str], torch.Tensor] = {}
        for item in _items(reader, config):
            if item.source == "param":
                item = replace(item, dtype=torch.float32)
            key = (item.source, item.key)
            if key not in by_key:
                by_key[key] = _read_item(reader, rest, item)
            out[item.name] = by_key[key]
    return out


# ---------------------------------------------------------------------------------- CLI
def export_main(args: argparse.Namespace) -> int:
    """Run ``flatzero export``; returns the exit status."""
    config = ExportConfig(
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_size,
        include_tied=args.include_tied,
        include_rest=not args.no_rest,
    )
    result = export_checkpoint(  # an error in the input: one line from flatzero.cli.main
        args.checkpoint,
        args.out_dir,
        tag=args.tag,
        config=config,
        overwrite=args.overwrite,
        verify=args.verify,
        progress=not args.no_progress,
    )
    print(
        f"wrote {result.tensors} tensors, {result.total_bytes / 2**20:.1f} MiB, into "
        f"{len(result.files)} file(s) in {result.out_dir} ({result.seconds:.1f} s)"
        + (f"; index {result.index}" if result.index else "")
    )
    return 0
