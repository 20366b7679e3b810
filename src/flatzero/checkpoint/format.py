"""The on-disk format of a flatzero checkpoint: names, the ``meta.json`` schema, JSON values.

A checkpoint directory holds any number of checkpoints (tags) and a ``latest`` pointer::

    CHECKPOINT_DIR/
        latest                                  text: the tag of the newest complete save
        <tag>/
            meta.json                           this module's ``CheckpointMeta``
            rank_00000-of-00004.safetensors     rank 0's shards: g0.master, g0.exp_avg, ...
            ...
            model_rest.safetensors              frozen params and buffers (optional)
        .tmp-<tag>-<nonce>/                     a save in progress (or killed): ignored

Every rank file holds, per layout group ``i`` and per sharded state (``master`` is the fp32
master shard; the others are the inner optimizer's per-element states such as
``exp_avg``), this rank's shard as one flat fp32 tensor named ``g<i>.<state>``. Scalar
state (the optimizer's ``step``, hyperparameters, loss scaler, scheduler, the user's
``extra``) is the same on every rank and lives in ``meta.json``. Values that JSON cannot
hold natively (0-d tensors, tuples) are tagged (``encode_value``/``decode_value``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..dtypes import dtype_name
from ..layout import Layout

__all__ = [
    "FORMAT",
    "LATEST",
    "MASTER",
    "META",
    "MODEL_REST",
    "TMP_PREFIX",
    "CheckpointDamaged",
    "CheckpointMeta",
    "CheckpointReplaced",
    "FileRecord",
    "GroupRecord",
    "available_tags",
    "check_tag",
    "damage",
    "decode_value",
    "encode_value",
    "rank_file_name",
    "read_latest",
    "resolve_tag",
    "state_key",
]

FORMAT = "flatzero.checkpoint/1"
"""The ``format`` entry of ``meta.json``."""

META = "meta.json"
"""Name of a checkpoint's metadata file."""

LATEST = "latest"
"""Name of the pointer file holding the tag of the newest complete checkpoint."""

MODEL_REST = "model_rest.safetensors"
"""Name of the file with the model's frozen params and buffers (not in the layout)."""

TMP_PREFIX = ".tmp-"
"""Prefix of a save in progress; loaders never look at such directories."""

MASTER = "master"
"""State name of the fp32 master weights."""


class CheckpointDamaged(ValueError):
    """A checkpoint is missing, incomplete or corrupt (not: it does not fit the model), so
    another, complete checkpoint of the directory may load instead."""


class CheckpointReplaced(CheckpointDamaged):
    """A checkpoint was replaced by another save while it was being loaded (its
    ``meta.json`` changed, or a rank file belongs to another save of the same tag): not
    damaged; loading it again reads the new one."""


@contextlib.contextmanager
def damage() -> Iterator[None]:
    """Turn a ``ValueError`` or ``OSError`` raised inside into ``CheckpointDamaged``."""
    try:
        yield
    except CheckpointDamaged:
        raise
    except (ValueError, OSError) as error:
        raise CheckpointDamaged(str(error)) from error


def rank_file_name(rank: int, world_size: int) -> str:
    """``rank_00003-of-00004.safetensors``."""
    return f"rank_{rank:05d}-of-{world_size:05d}.safetensors"


def state_key(group: int, state: str) -> str:
    """The tensor name of layout group ``group``'s shard of ``state`` in a rank file."""
    return f"g{group}.{state}"


def check_tag(tag: str) -> str:
    """Return ``tag`` if it is a usable directory name, else raise ``ValueError``."""
    if (
        not isinstance(tag, str)
        or not tag
        or tag in (".", "..")
        or "/" in tag
        or "\\" in tag
        or tag.startswith(".")
        or tag == LATEST
        or "\n" in tag
    ):
        raise ValueError(
            f"checkpoint tag {tag!r} is not usable as a directory name: use a non-empty name "
            f"without '/', not starting with '.', other than {LATEST!r} (e.g. 'step100')"
        )
    return tag


# ------------------------------------------------------------------------ JSON values
def encode_value(value: Any, where: str = "value") -> Any:
    """``value`` as JSON-able data: 0-d (or one-element) tensors and tuples are tagged.

    Raises:
        TypeError: ``value`` holds something else JSON cannot represent (named by ``where``).
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(
                f"{where} is a tensor of shape {tuple(value.shape)}; only scalar tensors can "
                "be stored as JSON (per-element state must have the shard's shape)"
            )
        item = value.detach().cpu().reshape(()).item()
        dtype = dtype_name(value.dtype)
        return {"__tensor__": _encode_float(item), "dtype": dtype, "shape": list(value.shape)}
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return _encode_float(value)
    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"{where} has a key {k!r} of type {type(k).__name__}; use str")
            out[str(k) if isinstance(k, str) else f"__int__{k}"] = encode_value(
                v, f"{where}[{k!r}]"
            )
        return out
    if isinstance(value, torch.dtype):
        return {"__dtype__": dtype_name(value)}
    raise TypeError(
        f"{where} is a {type(value).__name__}, which a checkpoint cannot store as JSON; store "
        "plain numbers, strings, lists, dicts or scalar tensors"
    )


def _encode_float(x: float | int | bool) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return {"__float__": repr(x)}
    return x


def decode_value(data: Any) -> Any:
    """Inverse of ``encode_value``."""
    if isinstance(data, list):
        return [decode_value(v) for v in data]
    if not isinstance(data, dict):
        return data
    if "__tensor__" in data:
        dtype = getattr(torch, data["dtype"])
        return torch.tensor(decode_value(data["__tensor__"]), dtype=dtype).reshape(
            data.get("shape", [])
        )
    if "__tuple__" in data:
        return tuple(decode_value(v) for v in data["__tuple__"])
    if "__float__" in data:
        return float(data["__float__"])
    if "__dtype__" in data:
        return getattr(torch, data["__dtype__"])
    return {
        (int(k[len("__int__") :]) if k.startswith("__int__") else k): decode_value(v)
        for k, v in data.items()
    }


# ------------------------------------------------------------------------- meta.json
@dataclass(frozen=True)
class FileRecord:
    """One rank file as written.

    Attributes:
        rank: the rank that wrote it.
        file: its name inside the checkpoint directory.
        bytes: its size in bytes.
        tensors: per tensor name, ``{"dtype", "shape", "checksum"}`` (``checksum``: the
            chunked checksums of the tensor's bytes, ``checksum.ChunkSums.to_dict``; absent
            when checksums were off; checkpoints of older versions hold one ``crc32``).
    """

    rank: int
    file: str
    bytes: int
    tensors: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class GroupRecord:
    """The optimizer state of one layout group that is not sharded.

    Attributes:
        states: names of the sharded per-element states in the rank files, ``master``
            first (``exp_avg``, ``exp_avg_sq`` for AdamW; none before the first step).
        scalars: the inner optimizer's scalar state of the group (``step``), encoded.
        hyperparams: the inner optimizer's param group without ``params`` (``lr``, ...),
            encoded.
    """

    states: tuple[str, ...]
    scalars: dict[str, Any]
    hyperparams: dict[str, Any]


def _optional_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _rest_record(data: dict[str, Any]) -> FileRecord | None:
    """The model rest's record of ``meta.json`` data (None when not recorded)."""
    record, name = data.get("model_rest_record"), data.get("model_rest")
    if record is None or name is None:
        return None
    return FileRecord(-1, str(name), int(record["bytes"]), dict(record["tensors"]))


@dataclass(frozen=True)
class CheckpointMeta:
    """Everything in ``meta.json``.

    Attributes:
        tag: the checkpoint's tag (its directory name).
        layout: the layout the shards were written with (world size, buckets, params).
        groups: one ``GroupRecord`` per layout group.
        files: one ``FileRecord`` per rank, in rank order.
        optimizer: the inner optimizer's class name (``"AdamW"``) or None.
        stage: the ZeRO stage it was trained with (1 or 2), or None.
        loss_scaler: the loss scaler's state, or None.
        scheduler: the LR scheduler's ``state_dict()``, encoded, or None.
        extra: the user's JSON-able client state, encoded (``{}`` when none).
        rng: whether the rank files hold the ranks' RNG states.
        model_rest: file name of the frozen params and buffers, or None.
        rest_record: that file's record (size, and per tensor dtype, shape and checksums),
            or None (none, or written before flatzero recorded it: then not verified).
        model_names: layout param name -> the model's name for it, where they differ.
        aliases: second names of tied params -> the name they are stored under.
        source: where the checkpoint came from (``"flatzero"``, ``"deepspeed 0.19.8"``).
        versions: library versions at save time.
        bucket_order: the order the optimizer launched its bucket reductions in (learned
            from backward); reused only by a load into the same layout.
        saved_at: when the save was published (seconds since the epoch), or None (written
            before flatzero recorded it: ``meta.json``'s modification time stands in).
        nonce: the save's random nonce, also in every rank file's header, so that a load
            never combines this ``meta.json`` with another save's files; None (written
            before flatzero recorded it, or by an importer: not checked).
        run_id: the id of the job that saved it (``run_id.run_id``), or None.
    """

    tag: str
    layout: Layout
    groups: tuple[GroupRecord, ...]
    files: tuple[FileRecord, ...]
    optimizer: str | None = None
    stage: int | None = None
    loss_scaler: dict[str, Any] | None = None
    scheduler: Any = None
    extra: Any = field(default_factory=dict)
    rng: bool = False
    model_rest: str | None = None
    model_names: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    source: str = "flatzero"
    versions: dict[str, str] = field(default_factory=dict)
    bucket_order: list[int] | None = None
    saved_at: float | None = None
    rest_record: FileRecord | None = None
    nonce: str | None = None
    run_id: str | None = None

    @property
    def world_size(self) -> int:
        """Ranks the checkpoint was written by."""
        return self.layout.world_size

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (``meta.json``)."""
        return {
            "format": FORMAT,
            "tag": self.tag,
            "world_size": self.world_size,
            "layout_digest": self.layout.digest(),
            "source": self.source,
            "versions": dict(self.versions),
            "optimizer": self.optimizer,
            "stage": self.stage,
            "groups": [
                {"states": list(g.states), "scalars": g.scalars, "hyperparams": g.hyperparams}
                for g in self.groups
            ],
            "loss_scaler": self.loss_scaler,
            "scheduler": self.scheduler,
            "extra": self.extra,
            "rng": self.rng,
            "model_rest": self.model_rest,
            "model_rest_record": (
                None
                if self.rest_record is None
                else {"bytes": self.rest_record.bytes, "tensors": self.rest_record.tensors}
            ),
            "model_names": self.model_names,
            "aliases": self.aliases,
            "bucket_order": self.bucket_order,
            "saved_at": self.saved_at,
            "nonce": self.nonce,
            "run_id": self.run_id,
            "files": [
                {"rank": f.rank, "file": f.file, "bytes": f.bytes, "tensors": f.tensors}
                for f in self.files
            ],
            "layout": self.layout.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Any, path: str | os.PathLike[str] = META) -> CheckpointMeta:
        """Parse ``meta.json`` data; ``ValueError`` naming ``path`` when it is not valid."""
        where = os.fspath(path)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(
                f"{where} is not a flatzero checkpoint description (format {found!r}, "
                f"expected {FORMAT!r}); point at a directory written by flatzero's "
                "save_checkpoint or import-deepspeed"
            )
        try:
            layout = Layout.from_dict(data["layout"])
            groups = tuple(
                GroupRecord(tuple(g["states"]), dict(g["scalars"]), dict(g["hyperparams"]))
                for g in data["groups"]
            )
            files = tuple(
                FileRecord(int(f["rank"]), str(f["file"]), int(f["bytes"]), dict(f["tensors"]))
                for f in data["files"]
            )
            meta = cls(
                tag=str(data["tag"]),
                layout=layout,
                groups=groups,
                files=files,
                optimizer=data.get("optimizer"),
                stage=data.get("stage"),
                loss_scaler=data.get("loss_scaler"),
                scheduler=data.get("scheduler"),
                extra=data.get("extra", {}),
                rng=bool(data.get("rng", False)),
                model_rest=data.get("model_rest"),
                model_names=dict(data.get("model_names", {})),
                aliases=dict(data.get("aliases", {})),
                source=str(data.get("source", "flatzero")),
                versions=dict(data.get("versions", {})),
                bucket_order=data.get("bucket_order"),
                saved_at=data.get("saved_at"),
                rest_record=_rest_record(data),
                nonce=_optional_str(data.get("nonce")),
                run_id=_optional_str(data.get("run_id")),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(
                f"{where} is damaged or incomplete ({type(error).__name__}: {error}); the "
                "checkpoint cannot be loaded: load another tag"
            ) from error
        if data.get("layout_digest") not in (None, layout.digest()):
            raise ValueError(
                f"{where}: its layout does not hash to the recorded layout_digest; the file "
                "was edited or damaged: load another tag"
            )
        if len(groups) != len(layout.groups):
            raise ValueError(
                f"{where} describes {len(groups)} optimizer groups but its layout has "
                f"{len(layout.groups)}; the file is damaged: load another tag"
            )
        if [f.rank for f in files] != list(range(layout.world_size)):
            raise ValueError(
                f"{where} lists files for ranks {[f.rank for f in files]} but the checkpoint "
                f"was written by {layout.world_size} ranks; the file is damaged"
            )
        return meta

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write ``meta.json`` to ``path`` and fsync it."""
        text = json.dumps(self.to_dict(), indent=1, allow_nan=False)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> CheckpointMeta:
        """Read and validate a ``meta.json``."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ValueError(
                f"{os.fspath(path)} does not exist: this is not a complete flatzero "
                "checkpoint (a save that did not finish leaves only a .tmp-* directory)"
            ) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(
                f"{os.fspath(path)} cannot be read as JSON ({error}); the checkpoint is "
                "damaged: load another tag"
            ) from error
        return cls.from_dict(data, path)


# ---------------------------------------------------------------------- tags, latest
def read_latest(directory: str | os.PathLike[str]) -> str:
    """The tag in ``directory/latest``; ``ValueError`` naming the file when unusable."""
    path = Path(directory) / LATEST
    try:
        tag = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise ValueError(
            f"{path} does not exist: {os.fspath(directory)} holds no complete flatzero "
            "checkpoint, or was written without one; pass the tag explicitly"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} cannot be read ({error}); pass the tag explicitly") from error
    try:
        return check_tag(tag)
    except ValueError:
        raise ValueError(
            f"{path} holds {tag[:80]!r}, not a checkpoint tag; it is damaged: pass the tag "
            "explicitly"
        ) from None


def resolve_tag(directory: str | os.PathLike[str], tag: str | None) -> tuple[str, Path]:
    """``(tag, checkpoint path)``: ``tag`` or the one ``latest`` names, checked to exist.

    ``directory`` may also be a checkpoint itself (a directory holding ``meta.json``) when
    ``tag`` is None.
    """
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"checkpoint directory {os.fspath(root)} does not exist")
    if tag is None and (root / META).is_file() and not (root / LATEST).exists():
        return root.name, root
    tag = read_latest(root) if tag is None else check_tag(tag)
    path = root / tag
    if not (path / META).is_file():
        raise ValueError(
            f"checkpoint {os.fspath(path)} does not exist or is incomplete (no {META}); "
            "tags here: " + ", ".join(sorted(available_tags(root))[:10] or ["none"])
        )
    return tag, path


def available_tags(directory: str | os.PathLike[str]) -> list[str]:
    """Tags of the complete checkpoints in ``directory`` (unordered)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return [
        p.name
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".") and (p / META).is_file()
    ]
