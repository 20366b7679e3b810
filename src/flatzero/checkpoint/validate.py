"""Everything a load reads from a checkpoint, checked before anything is changed.

The layout digest in ``meta.json`` says the layout was not changed since the save; it says
nothing of the other fields, and a hand-edited file can carry a matching digest (or none).
``CheckpointMeta.from_dict`` checks that the fields are there; this module checks what
they say, on every rank, before the load changes a weight: ``meta.json`` alone
(``check_meta``), the rank files' tensors (``check_rank_files``), the fit to the optimizer
(``check_for_optimizer``) and to the scheduler (``check_scheduler_state``), the RNG states
(``check_rng``), and that every rank loads the same way (``agree_on_load_settings``) from
the same checkpoint (``agree_on_checkpoint``). Each function's docstring says what it
checks and what it raises; every message names the file, the field and what to do.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..comm import (
    all_reduce_max,
    all_reduce_max_each,
    check_same_everywhere,
    rank_of,
    world_size_of,
)
from ..dtypes import DTYPES
from ..layout import Layout
from ..optim import ZeroOptimizer
from ..optim.inner import needs_whole_params, optimizer_class_of
from ..own_groups import control_group
from .format import (
    META,
    CheckpointDamaged,
    CheckpointMeta,
    CheckpointReplaced,
    decode_value,
    state_key,
)
from .rng import RNG_PREFIX

__all__ = [
    "agree_on_checkpoint",
    "agree_on_load_settings",
    "check_for_optimizer",
    "check_meta",
    "check_rank_files",
    "check_rng",
    "check_scheduler_state",
]

_DTYPE_NAMES = frozenset(d.name for d in DTYPES)

_FIX = "the file was edited or damaged: load another tag, or save this one again"


class _Field:
    """A field of a checkpoint file, for messages: ``<file>: <field> ...; <fix>``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def damaged(self, field: str, rule: str) -> CheckpointDamaged:
        return CheckpointDamaged(f"{self.path}: {field} {rule}; {_FIX}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _plain_name(name: Any) -> bool:
    """A file name inside the checkpoint directory: no separator, not hidden or ``..``."""
    return (
        isinstance(name, str)
        and bool(name)
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and not name.startswith(".")
    )


def _decoded(value: Any, where: str, f: _Field) -> Any:
    """``decode_value(value)``, or ``CheckpointDamaged`` naming ``where``."""
    try:
        return decode_value(value)
    except Exception as error:  # an unknown dtype name, a tensor of text, ...
        raise f.damaged(where, f"cannot be decoded ({type(error).__name__}: {error})") from None


# ---------------------------------------------------------------------------- layout
def _check_layout(layout: Layout, f: _Field) -> None:
    """The layout's numbers describe buckets the loader can read."""
    for name, value in (
        ("world_size", layout.world_size),
        ("alignment", layout.alignment),
        ("bucket_numel", layout.bucket_numel),
    ):
        if not _is_int(value) or value < 1:
            raise f.damaged(f"layout.{name}", f"is {value!r}, not a positive whole number")
    names: set[str] = set()
    for gi, group in enumerate(layout.groups):
        where = f"layout.groups[{gi}]"
        if group.dtype not in _DTYPE_NAMES:
            raise f.damaged(f"{where}.dtype", f"is {group.dtype!r}, not a dtype flatzero knows")
        for si, slot in enumerate(group.slots):
            name = slot.spec.name
            if not isinstance(name, str) or not name or name in names:
                raise f.damaged(
                    f"{where}.params[{si}].name", f"is {name!r}: empty, not text, or used twice"
                )
            names.add(name)
            for key in ("registration_index", "bucket", "offset"):
                value = getattr(slot, key)
                if not _is_int(value) or value < 0:
                    raise f.damaged(f"{where}.params[{si}].{key}", f"is {value!r}")
            if slot.bucket >= len(group.buckets):
                raise f.damaged(
                    f"{where}.params[{si}].bucket",
                    f"is {slot.bucket} but the group has {len(group.buckets)} buckets",
                )
        _check_buckets(group, where, f)


def _check_buckets(group: Any, where: str, f: _Field) -> None:
    """Bucket indices, sizes, shard offsets and the params inside them are consistent."""
    shard_offset = 0
    by_bucket: dict[int, list[int]] = {}
    for i, slot in enumerate(group.slots):  # one pass: a big model has many of both
        by_bucket.setdefault(slot.bucket, []).append(i)
    for bi, bucket in enumerate(group.buckets):
        at = f"{where}.buckets[{bi}]"
        for key in ("index", "numel", "used", "shard_offset"):
            value = getattr(bucket, key)
            if not _is_int(value) or value < 0:
                raise f.damaged(f"{at}.{key}", f"is {value!r}, not a whole number >= 0")
        if bucket.index != bi:
            raise f.damaged(f"{at}.index", f"is {bucket.index}, expected {bi}")
        if bucket.numel % group.world_size or bucket.used > bucket.numel:
            raise f.damaged(
                f"{at}.numel",
                f"is {bucket.numel} (used {bucket.used}): not a multiple of the world size "
                f"{group.world_size} holding its params",
            )
        if bucket.shard_offset != shard_offset:
            raise f.damaged(
                f"{at}.shard_offset", f"is {bucket.shard_offset}, expected {shard_offset}"
            )
        shard_offset += bucket.numel // group.world_size
        members = by_bucket.get(bi, [])
        listed = list(bucket.slots)
        if sorted(listed) != members:
            raise f.damaged(
                f"{at}.slots", f"is {listed[:8]}, but params {members[:8]} name this bucket"
            )
        end = 0
        for i in sorted(members, key=lambda i: group.slots[i].offset):
            slot = group.slots[i]
            if slot.offset < end or slot.end > bucket.used:
                raise f.damaged(
                    f"{where}.params[{i}].offset",
                    f"is {slot.offset} ({slot.numel} elements): it overlaps another param or "
                    f"lies outside the bucket's {bucket.used} used elements",
                )
            end = slot.end


# ------------------------------------------------------------------------ meta.json
def check_meta(meta: CheckpointMeta, directory: Path) -> None:
    """Raise ``CheckpointDamaged`` naming ``meta.json`` and the field unless every field of
    ``meta`` is usable: the layout is consistent (world size, alignment, bucket sizes and
    shard offsets, every param inside its bucket, no overlaps, names unique); the rank
    files' and ``model_rest``'s names are plain file names; every tensor record's dtype is
    known and its shape is its group's shard; every group's state names, scalar state
    (``step`` a non-negative number) and hyperparameters decode; the loss scaler's state is
    finite and positive; the bucket order is a list of bucket indices; ``stage``,
    ``optimizer``, ``saved_at`` have their types."""
    f = _Field(directory / META)
    _check_layout(meta.layout, f)
    if meta.stage is not None and meta.stage not in (0, 1, 2):
        raise f.damaged("stage", f"is {meta.stage!r}, not 0, 1, 2 or null")
    if meta.optimizer is not None and not isinstance(meta.optimizer, str):
        raise f.damaged("optimizer", f"is {meta.optimizer!r}, not a class name or null")
    if meta.saved_at is not None and not (_is_number(meta.saved_at) and meta.saved_at >= 0):
        raise f.damaged("saved_at", f"is {meta.saved_at!r}, not a time in seconds")
    if meta.model_rest is not None and not _plain_name(meta.model_rest):
        raise f.damaged("model_rest", f"is {meta.model_rest!r}, not a file name in the checkpoint")
    for key in ("model_names", "aliases"):
        mapping = getattr(meta, key)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
            raise f.damaged(key, "must map names to names")
    _check_groups(meta, f)
    _check_files(meta, f)
    if meta.loss_scaler is not None:
        _check_loss_scaler(meta.loss_scaler, f)
    _check_bucket_order(meta, f)


def _check_groups(meta: CheckpointMeta, f: _Field) -> None:
    for gi, record in enumerate(meta.groups):
        where = f"groups[{gi}]"
        states = record.states
        if not states or states[0] != "master" or len(set(states)) != len(states):
            raise f.damaged(
                f"{where}.states", f"is {list(states)[:6]}; it must start with 'master', no repeats"
            )
        if not all(isinstance(s, str) and s and "." not in s for s in states):
            raise f.damaged(f"{where}.states", f"is {list(states)[:6]}, not state names")
        for key, value in record.scalars.items():
            decoded = _decoded(value, f"{where}.scalars[{key!r}]", f)
            if isinstance(decoded, torch.Tensor):
                if decoded.numel() != 1:
                    raise f.damaged(f"{where}.scalars[{key!r}]", "is not a scalar")
                decoded = decoded.item()
            if decoded is not None and not _is_number(decoded) and not isinstance(decoded, bool):
                raise f.damaged(f"{where}.scalars[{key!r}]", f"is {decoded!r}, not a number")
            if key == "step" and not (
                _is_number(decoded) and math.isfinite(decoded) and decoded >= 0
            ):
                raise f.damaged(f"{where}.scalars['step']", f"is {decoded!r}, not a step count")
        for key, value in record.hyperparams.items():
            _decoded(value, f"{where}.hyperparams[{key!r}]", f)


def _check_files(meta: CheckpointMeta, f: _Field) -> None:
    """Rank file names, sizes, and every tensor record against the layout."""
    layout = meta.layout
    for record in meta.files:
        where = f"files[{record.rank}]"
        if not _plain_name(record.file):
            raise f.damaged(f"{where}.file", f"is {record.file!r}, not a file name")
        if record.bytes < 0:
            raise f.damaged(f"{where}.bytes", f"is {record.bytes}")
        for key, info in record.tensors.items():
            at = f"{where}.tensors[{key!r}]"
            if not isinstance(info, Mapping) or info.get("dtype") not in _DTYPE_NAMES:
                raise f.damaged(f"{at}.dtype", "is missing or not a dtype flatzero knows")
            shape = info.get("shape")
            if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
                raise f.damaged(f"{at}.shape", f"is {shape!r}, not a list of sizes")
        for gi, (group, saved) in enumerate(zip(layout.groups, meta.groups, strict=True)):
            for state in saved.states:
                key = state_key(gi, state)
                info = record.tensors.get(key)
                if info is None:
                    raise f.damaged(f"{where}.tensors", f"lacks {key!r}, which groups[{gi}] lists")
                if info["shape"] != [group.shard_numel]:
                    raise f.damaged(
                        f"{where}.tensors[{key!r}].shape",
                        f"is {info['shape']}, but the layout gives group {gi} a shard of "
                        f"{group.shard_numel} elements",
                    )
                if state == "master" and info["dtype"] != "float32":
                    raise f.damaged(f"{where}.tensors[{key!r}].dtype", "is not float32")


def _check_loss_scaler(state: Any, f: _Field) -> None:
    keys = ("scale", "good_steps", "hysteresis_left", "skipped_steps")
    if not isinstance(state, Mapping) or any(k not in state for k in keys):
        raise f.damaged("loss_scaler", f"is {state!r}, not a dict with keys {', '.join(keys)}")
    scale = state["scale"]
    if not (_is_number(scale) and math.isfinite(scale) and scale > 0):
        raise f.damaged("loss_scaler.scale", f"is {scale!r}, not a finite number > 0")
    for key in keys[1:]:
        if not _is_int(state[key]) or state[key] < 0:
            raise f.damaged(f"loss_scaler.{key}", f"is {state[key]!r}, not a count >= 0")


def _check_bucket_order(meta: CheckpointMeta, f: _Field) -> None:
    order = meta.bucket_order
    if order is None:
        return
    if not isinstance(order, list) or not all(_is_int(i) and i >= 0 for i in order):
        raise f.damaged("bucket_order", f"is {str(order)[:80]}, not a list of bucket indices")


# ------------------------------------------------------------------------ rank files
def check_rank_files(reader: Any, ranks: set[int]) -> None:
    """The tensors of the given ranks' files have the dtype and shape ``meta.json``
    records (opening them; ``CheckpointDamaged`` naming the file and tensor)."""
    for rank in sorted(ranks):
        file = reader.tensor_file(rank)
        for key, record in reader.meta.files[rank].tensors.items():
            info = file.info(key)
            if (str(info.dtype).removeprefix("torch."), list(info.shape)) != (
                record["dtype"],
                record["shape"],
            ):
                raise CheckpointDamaged(
                    f"{reader.file_path(rank)}: tensor {key!r} is {info.dtype} of shape "
                    f"{list(info.shape)}, but {reader.path / META} records {record['dtype']} "
                    f"of shape {record['shape']}; {_FIX}"
                )


# ------------------------------------------------------------------------- optimizer
def _probe_state_names(cls: type, options: dict[str, Any]) -> tuple[set[str], set[str]]:
    """``(per-element, scalar)`` state names ``cls`` keeps after a step with ``options``
    (on a throwaway 3-element param, 2-D for an optimizer of whole matrices);
    ``cls``'s constructor checks the options."""
    shape = (1, 3) if needs_whole_params(cls) else (3,)
    param = torch.nn.Parameter(torch.zeros(shape))
    param.grad = torch.zeros(shape)
    accepted = inspect.signature(cls.__init__).parameters
    inner = cls([param], **{k: v for k, v in options.items() if k in accepted})
    inner.param_groups[0].update(options)  # group keys the constructor does not take
    inner.step()
    elementwise = {
        k for k, v in inner.state[param].items() if isinstance(v, torch.Tensor) and v.numel() == 3
    }
    return elementwise, set(inner.state[param]) - elementwise


def check_for_optimizer(meta: CheckpointMeta, directory: Path, optimizer: ZeroOptimizer) -> None:
    """Raise ``ValueError`` naming ``meta.json``'s field unless the saved optimizer state
    fits ``optimizer`` (a ``ZeroOptimizer``): saved hyperparameters its inner class
    accepts, and the state names that class keeps with them."""
    inner = optimizer.inner
    cls = optimizer_class_of(inner)
    where = directory / META
    if meta.optimizer is not None and meta.optimizer != cls.__name__:
        return  # check_same_optimizer says it (or the state is not loaded)
    live = inner.param_groups[0] if inner.param_groups else {}
    for gi, record in enumerate(meta.groups):
        # Keys the optimizer lacks are kept (a scheduler adds ``initial_lr``, ...).
        options = {k: v for k, v in live.items() if k not in ("params", "param_names")}
        for key, value in record.hyperparams.items():
            saved = decode_value(value)
            if isinstance(options.get(key), tuple) and isinstance(saved, list):
                saved = tuple(saved)
            options[key] = saved
        try:
            elementwise, scalars = _probe_state_names(cls, options)
        except Exception as error:
            raise ValueError(
                f"{where}: groups[{gi}].hyperparams are refused by {cls.__name__} "
                f"({type(error).__name__}: {error}); {_FIX}"
            ) from None
        saved_states = set(record.states[1:])
        if not saved_states and not record.scalars:
            continue  # saved before the first step
        if saved_states != elementwise or set(record.scalars) != scalars:
            raise ValueError(
                f"{where}: groups[{gi}] holds states {sorted(saved_states)} and scalars "
                f"{sorted(record.scalars)}, but {cls.__name__} with these hyperparameters keeps "
                f"{sorted(elementwise)} and {sorted(scalars)}: the state is not this "
                "optimizer's; configure the optimizer it was saved with, or load the weights "
                "only (load_optimizer_states=False)"
            )


# ------------------------------------------------------------------------- scheduler
def _same_shape(saved: Any, live: Any, where: str) -> str | None:
    """Where ``saved`` has another structure or type than ``live``, or None."""
    if live is None or saved is None:
        return None
    if isinstance(live, bool) or isinstance(saved, bool):
        return None if isinstance(saved, bool) == isinstance(live, bool) else where
    if _is_number(live):
        ok = _is_number(saved) and (not isinstance(saved, float) or not math.isnan(saved))
        return None if ok else where
    if isinstance(live, str):
        return None if isinstance(saved, str) else where
    if isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(live):
            return where
        for i, (s, v) in enumerate(zip(saved, live, strict=True)):
            found = _same_shape(s, v, f"{where}[{i}]")
            if found:
                return found
        return None
    if isinstance(live, Mapping):
        if not isinstance(saved, Mapping):
            return where
        for key in live:
            if key in saved:
                found = _same_shape(saved[key], live[key], f"{where}[{key!r}]")
                if found:
                    return found
        return None
    return None


def check_scheduler_state(state: Any, scheduler: Any, directory: Path) -> None:
    """Raise ``ValueError`` unless ``state`` (saved) has the keys and value types of
    ``scheduler.state_dict()``, and a ``last_epoch`` >= -1."""
    where = directory / META
    reads_foreign = getattr(scheduler, "reads_foreign_state", None)
    if reads_foreign is not None and reads_foreign(state):
        return  # another program's format that the scheduler maps itself
    live = scheduler.state_dict()
    if not isinstance(state, Mapping):
        raise ValueError(
            f"{where}: scheduler is a {type(state).__name__}, not a state dict; {_FIX}"
        )
    missing = sorted(k for k in live if k not in state)
    extra = sorted(k for k in state if k not in live)
    if missing or extra:
        raise ValueError(
            f"{where}: scheduler state has keys {sorted(state)[:8]}, but this "
            f"{type(scheduler).__name__} has {sorted(live)[:8]} (missing {missing[:4]}, "
            f"unknown {extra[:4]}): it was saved by another scheduler; configure that one, or "
            "load without the scheduler (load_lr_scheduler_states=False)"
        )
    found = _same_shape(dict(state), live, "scheduler")
    if found is not None:
        raise ValueError(
            f"{where}: {found} has another type or length than this "
            f"{type(scheduler).__name__}'s (param groups, numbers); {_FIX}"
        )
    last = state.get("last_epoch")
    if last is not None and not (_is_int(last) and last >= -1):
        raise ValueError(f"{where}: scheduler['last_epoch'] is {last!r}, not a step >= -1; {_FIX}")


# ------------------------------------------------------------------------------- rng
def check_rng(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], path: Path) -> None:
    """Set the saved RNG states on throwaway generators first (``CheckpointDamaged``
    naming the file and the state when one is refused)."""
    name = ""
    try:
        name = RNG_PREFIX + "torch"
        if name in tensors:
            torch.Generator().set_state(tensors[name])
        for key, tensor in tensors.items():
            name = key
            if tensor.dtype != torch.uint8:
                raise ValueError(f"dtype {tensor.dtype}, not uint8")
        name = RNG_PREFIX + "python"
        if name in metadata:
            version, internal, gauss = json.loads(metadata[name])
            random.Random().setstate((version, tuple(internal), gauss))
        name = RNG_PREFIX + "numpy"
        if name in metadata:
            import numpy as np

            kind, keys, pos, has_gauss, cached = json.loads(metadata[name])
            state = (kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)
            np.random.RandomState().set_state(state)
    except Exception as error:
        raise CheckpointDamaged(
            f"{path}: RNG state {name!r} cannot be restored ({type(error).__name__}: {error}); "
            f"{_FIX}, or load with LoadConfig(load_rng=False)"
        ) from None


# -------------------------------------------------------------------------- agreement
def fingerprint(meta: CheckpointMeta) -> str:
    """A hash of everything ``meta.json`` says (two saves differ at least in their files'
    checksums or their time)."""
    text = json.dumps(meta.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def agree_on_load_settings(settings: Mapping[str, Any], group: dist.ProcessGroup | None) -> None:
    """``ValueError`` on every rank unless every rank loads the same way (``LoadConfig``,
    and whether a scheduler and a model are restored): a rank that alone skips the
    optimizer state or the scheduler would train on with other moments or another learning
    rate than the others, silently. Collective on the control group (one all-reduce)."""
    check_same_everywhere(
        "the load settings (every rank must load the same way)",
        {name: repr(value) for name, value in settings.items()},
        control_group(group),
        fix="Pass the same load arguments on every rank",
    )


def agree_on_checkpoint(reader: Any, group: dist.ProcessGroup | None) -> None:
    """``ValueError`` on every rank unless every rank opened the same checkpoint: the same
    tag with the same ``meta.json`` (an identical copy on another node's disk is the same);
    ``CheckpointReplaced`` when they differ because a save replaced it meanwhile.
    Collective on the control group: one small all-reduce; the paths are gathered only to
    say which rank opened which."""
    control = control_group(group)
    if world_size_of(control) == 1:
        return
    mine = f"tag {reader.tag!r}, meta.json {fingerprint(reader.meta)}"
    digest = int.from_bytes(hashlib.sha256(mine.encode()).digest()[:7], "little")
    high, neg_low = all_reduce_max_each([digest, -digest], control)
    if high == -neg_low:
        return
    if all_reduce_max(int(reader.replaced()), control):  # a save replaced it meanwhile
        raise CheckpointReplaced(
            f"{reader.path} was replaced by another save while the ranks loaded it (they "
            "read different meta.json); load it again"
        )
    seen: list[str] = [""] * world_size_of(control)
    text = f"rank {rank_of(None)}: {reader.path} ({mine})"
    dist.all_gather_object(seen, text, group=control)
    raise ValueError(
        "ranks opened different checkpoints (" + "; ".join(seen) + "): their rank files would "
        "be mixed; pass the same directory and tag on every rank, on a file system every "
        "rank shares (not a node-local disk)"
    )
