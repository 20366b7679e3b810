"""``flatzero import-deepspeed``: a DeepSpeed ZeRO-1/2 checkpoint as a flatzero checkpoint.

What DeepSpeed (0.19.x) writes for ZeRO stage 1 and 2, data parallel only, in
``DS_DIR/<tag>/`` (``DS_DIR/latest`` holds the tag):

- ``mp_rank_00_model_states.pt``: ``module`` (the full model state dict in the training
  dtype), ``param_shapes`` (per optimizer group, an ordered ``{name: shape}`` in the order
  of the group's flat buffer), ``buffer_names``, ``frozen_param_shapes``,
  ``shared_params`` (tied names), ``lr_scheduler``, ``global_steps``, ``ds_config``, ...
- per data-parallel rank ``r``, ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (prefixed
  ``bf16_`` with bf16): ``optimizer_state_dict`` with ``single_partition_of_fp32_groups``
  (per group, rank ``r``'s fp32 partition, trailing padding stripped or not),
  ``base_optimizer_state`` (the torch optimizer's ``state_dict()`` whose state ``i`` is
  group ``i``'s partition: ``exp_avg``, ``exp_avg_sq``, ``step``; a list of per-group
  states with ``elastic_checkpoint``), ``partition_count``, ``group_paddings``,
  ``param_alignment_paddings`` (padding after each param, 0.19+), ``loss_scaler``.

Each group's params are concatenated in ``param_shapes`` order (plus any per-param
alignment padding), the whole padded to a multiple of ``2 * world_size`` elements, and cut
into ``world_size`` equal partitions (as ``zero_to_fp32.py`` reconstructs them). This
reader derives, per param, which ranks' partitions hold which of its elements, and the
importer copies them into a flatzero layout through the same resharding plans as a
flatzero load, rank file by rank file, reading only the needed slices of the
memory-mapped DeepSpeed files. DeepSpeed itself is not needed: its pickled classes are
read as plain records.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import pickle
import re
import secrets
import shutil
import time
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import DEFAULT_BUCKET_NUMEL
from ..layout import ParamSpec, plan_layout
from .atomic import publish, tmp_dir_name, write_latest
from .format import (
    MASTER,
    MODEL_REST,
    CheckpointMeta,
    GroupRecord,
    check_tag,
    encode_value,
    state_key,
)
from .reshard import ParamRecord, Segment, execute, plan_reads
from .writer import write_rank_file, write_tensors

__all__ = [
    "DeepSpeedCheckpoint",
    "add_import_deepspeed_arguments",
    "import_deepspeed",
    "import_deepspeed_main",
    "read_deepspeed",
]

logger = logging.getLogger(__name__)

_MODEL_STATES = "mp_rank_00_model_states.pt"
_OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_ALIGN_FACTOR = 2  # DeepSpeed's nccl_start_alignment_factor


# ------------------------------------------------------------------ unpickling, no DS
class _Record:
    """Stands in for any DeepSpeed class found in a pickle (enums, loss scalers, ...)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self.args or ''}"


_RECORD_TYPES: dict[tuple[str, str], type] = {}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "deepspeed" or module.startswith("deepspeed."):
            key = (module, name)
            if key not in _RECORD_TYPES:
                _RECORD_TYPES[key] = type(name, (_Record,), {"__module__": "flatzero._ds"})
            return _RECORD_TYPES[key]
        return super().find_class(module, name)


class _PickleModule:
    """A ``pickle_module`` for ``torch.load`` that does not need DeepSpeed installed."""

    Unpickler = _Unpickler
    __name__ = "flatzero_deepspeed_pickle"

    @staticmethod
    def load(file: Any, **kwargs: Any) -> Any:
        return _Unpickler(file, **kwargs).load()


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(
            path, map_location="cpu", weights_only=False, mmap=True, pickle_module=_PickleModule
        )
    except Exception as error:
        raise ValueError(
            f"{path} cannot be read as a DeepSpeed checkpoint file ({type(error).__name__}: "
            f"{error}); it is damaged or not a torch.save file"
        ) from error


# --------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class _Group:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]  # element offset of each param in the group's flat buffer
    partition_numel: int


@dataclass
class DeepSpeedCheckpoint:
    """A DeepSpeed ZeRO-1/2 checkpoint, opened (files memory-mapped).

    Attributes:
        path: the tag directory.
        tag: its tag.
        world_size: data-parallel ranks it was saved by.
        stage: ZeRO stage (1 or 2).
        groups: per optimizer group, its params in flat order and partition size.
        model_states: the contents of ``mp_rank_00_model_states.pt``.
        optim_files: per rank, its optimizer-state file.
        dtypes: param name -> dtype name of the trained params.
    """

    path: Path
    tag: str
    world_size: int
    stage: int
    groups: list[_Group]
    model_states: dict[str, Any]
    optim_files: list[Path]
    dtypes: dict[str, str]
    _optim: dict[int, dict[str, Any]]

    def optim_state(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s ``optimizer_state_dict`` (loaded once, memory-mapped)."""
        if rank not in self._optim:
            data = _torch_load(self.optim_files[rank])
            sd = data.get("optimizer_state_dict") if isinstance(data, dict) else None
            if not isinstance(sd, dict) or "single_partition_of_fp32_groups" not in sd:
                raise ValueError(
                    f"{self.optim_files[rank]} has no ZeRO-1/2 optimizer state "
                    "(optimizer_state_dict.single_partition_of_fp32_groups); it was not "
                    "written by a DeepSpeed ZeRO stage 1 or 2 optimizer"
                )
            self._check_partitions(rank, sd)
            self._optim[rank] = sd
        return self._optim[rank]

    def _check_partitions(self, rank: int, sd: dict[str, Any]) -> None:
        parts = sd["single_partition_of_fp32_groups"]
        if len(parts) != len(self.groups):
            raise ValueError(
                f"{self.optim_files[rank]} has {len(parts)} fp32 partitions but "
                f"{_MODEL_STATES} describes {len(self.groups)} groups"
            )
        paddings = sd.get("group_paddings") or [0] * len(parts)
        for gi, (part, group) in enumerate(zip(parts, self.groups, strict=True)):
            n = part.numel()
            if n != group.partition_numel and n + paddings[gi] != group.partition_numel:
                raise ValueError(
                    f"{self.optim_files[rank]}: group {gi}'s fp32 partition has {n} elements; "
                    f"the param shapes give partitions of {group.partition_numel}. The files "
                    "belong to different checkpoints or use an unsupported layout"
                )

    def inner_state(self, rank: int, group: int) -> dict[str, Any]:
        """The torch optimizer's state of ``group`` on ``rank`` (``exp_avg``, ``step``...)."""
        sd = self.optim_state(rank)
        base = sd.get("base_optimizer_state")
        if isinstance(base, dict) and "state" in base:
            state = dict(base["state"].get(group, {}))
        elif isinstance(base, (list, tuple)):
            state = dict(base[group])
            if "base_optimizer_state_step" in sd and "step" not in state:
                state["step"] = sd["base_optimizer_state_step"]
        else:
            state = {}
        return state

    def hyperparams(self, group: int) -> dict[str, Any]:
        """The torch optimizer's param group ``group`` without ``params``."""
        base = self.optim_state(0).get("base_optimizer_state")
        if isinstance(base, dict) and "param_groups" in base:
            return {k: v for k, v in base["param_groups"][group].items() if k != "params"}
        return {}

    def index(self) -> dict[str, ParamRecord]:
        """Where each param's elements lie: sources are ``(rank, group)``."""
        out: dict[str, ParamRecord] = {}
        for gi, g in enumerate(self.groups):
            width = g.partition_numel
            for name, shape, offset in zip(g.names, g.shapes, g.offsets, strict=True):
                numel = math.prod(shape)
                segs = []
                pos = offset
                while pos < offset + numel:
                    rank = pos // width
                    end = min(offset + numel, (rank + 1) * width)
                    segs.append(Segment(pos - offset, end - offset, (rank, gi), pos - rank * width))
                    pos = end
                out[name] = ParamRecord(name, shape, self.dtypes[name], gi, tuple(segs))
        return out

    def fetcher(self, state: str) -> Any:
        """``fetch(source, start, numel)`` over the ranks' partitions of ``state``."""

        def fetch(source: Hashable, start: int, numel: int) -> torch.Tensor:
            rank, group = source  # type: ignore[misc]
            if state == MASTER:
                tensor = self.optim_state(rank)["single_partition_of_fp32_groups"][group]
            else:
                tensor = self.inner_state(rank, group).get(state)
                if not isinstance(tensor, torch.Tensor):
                    raise ValueError(
                        f"{self.optim_files[rank]} has no optimizer state {state!r} for group "
                        f"{group}; the ranks' files disagree: the checkpoint is damaged"
                    )
            return tensor.reshape(-1)[start : start + numel]

        return fetch


def _resolve_ds_tag(ds_dir: Path, tag: str | None) -> tuple[str, Path]:
    if not ds_dir.is_dir():
        raise ValueError(f"DeepSpeed checkpoint directory {ds_dir} does not exist")
    if tag is None and (ds_dir / _MODEL_STATES).is_file():
        return ds_dir.name, ds_dir
    if tag is None:
        latest = ds_dir / "latest"
        if not latest.is_file():
            raise ValueError(
                f"{latest} does not exist; pass the tag (the subdirectory DeepSpeed saved, "
                "e.g. global_step100) explicitly"
            )
        tag = latest.read_text(encoding="utf-8").strip()
    path = ds_dir / tag
    if not (path / _MODEL_STATES).is_file():
        if list(path.glob("zero_pp_rank_*_mp_rank_00_model_states.pt")):
            raise ValueError(
                f"{path} is a ZeRO stage 3 checkpoint (per-rank model states); only ZeRO stage "
                "1 and 2 checkpoints can be imported"
            )
        raise ValueError(
            f"{path / _MODEL_STATES} does not exist: not a DeepSpeed ZeRO-1/2 checkpoint of "
            "a data-parallel (not tensor- or pipeline-parallel) run"
        )
    return tag, path


def read_deepspeed(ds_dir: str | os.PathLike[str], tag: str | None = None) -> DeepSpeedCheckpoint:
    """Open a DeepSpeed ZeRO-1/2 checkpoint (``DS_DIR`` with ``latest``, or a tag dir).

    Raises:
        ValueError: not a ZeRO-1/2 data-parallel checkpoint, missing rank files, or files
            that disagree (each error names the file).
    """
    tag, path = _resolve_ds_tag(Path(ds_dir), tag)
    model_path = path / _MODEL_STATES
    states = _torch_load(model_path)
    if not isinstance(states, dict) or "param_shapes" not in states or "module" not in states:
        raise ValueError(
            f"{model_path} lacks 'param_shapes' or 'module'; it was not written by "
            "DeepSpeed's engine.save_checkpoint with ZeRO stage 1 or 2"
        )
    if int(states.get("mp_world_size", 1) or 1) != 1:
        raise ValueError(
            f"{model_path}: model parallel size {states['mp_world_size']}; only pure data "
            "parallel checkpoints can be imported"
        )
    if list(path.glob("expp_rank_*")):
        raise ValueError(f"{path} holds MoE expert-parallel files; they cannot be imported")
    files: dict[int, Path] = {}
    for p in path.iterdir():
        m = _OPTIM_RE.match(p.name)
        if m:
            files[int(m.group(2))] = p
    world_size = int(states.get("dp_world_size") or len(files))
    missing = [r for r in range(world_size) if r not in files]
    if missing or not files:
        raise ValueError(
            f"{path} lacks the optimizer-state files of ranks {missing or [0]} "
            f"(*zero_pp_rank_<r>_mp_rank_00_optim_states.pt); the checkpoint is incomplete"
        )
    module = states["module"]
    dtypes = {}
    groups = []
    first = _torch_load(files[0]).get("optimizer_state_dict", {})
    paddings = first.get("param_alignment_paddings") or []
    for gi, shapes in enumerate(states["param_shapes"]):
        names = tuple(shapes.keys())
        dims = tuple(tuple(int(d) for d in shapes[n]) for n in names)
        pads = list(paddings[gi]) if gi < len(paddings) else [0] * len(names)
        offsets, pos = [], 0
        for dim, pad in zip(dims, pads, strict=True):
            offsets.append(pos)
            pos += math.prod(dim) + int(pad)
        align = _ALIGN_FACTOR * world_size
        flat = -(-pos // align) * align
        groups.append(_Group(names, dims, tuple(offsets), flat // world_size))
        for n in names:
            tensor = module.get(n)
            dtypes[n] = (
                str(tensor.dtype).removeprefix("torch.") if tensor is not None else "float32"
            )
    stage_value = first.get("zero_stage")
    stage = getattr(stage_value, "args", (stage_value,))[0] if stage_value is not None else None
    ds_config = states.get("ds_config") or {}
    if stage is None:
        stage = int(ds_config.get("zero_optimization", {}).get("stage", 0) or 0)
    if stage not in (1, 2):
        raise ValueError(f"{path}: ZeRO stage {stage!r}; only stages 1 and 2 can be imported")
    ckpt = DeepSpeedCheckpoint(
        path,
        tag,
        world_size,
        int(stage),
        groups,
        states,
        [files[r] for r in range(world_size)],
        dtypes,
        {},
    )
    ckpt._optim[0] = first
    ckpt._check_partitions(0, first)
    return ckpt


# -------------------------------------------------------------------------- importing
def _loss_scaler(ds: DeepSpeedCheckpoint) -> dict[str, Any] | None:
    scaler = ds.optim_state(0).get("loss_scaler")
    if scaler is None or (
        not getattr(scaler, "dynamic", False) and getattr(scaler, "cur_scale", 1.0) == 1.0
    ):
        return None
    scale = float(getattr(scaler, "cur_scale", 1.0))
    window = int(getattr(scaler, "scale_window", 1000) or 1000)
    good = int(getattr(scaler, "cur_iter", 0)) - int(getattr(scaler, "last_overflow_iter", -1)) - 1
    return {
        "scale": scale,
        "good_steps": max(0, good) % window,
        "hysteresis_left": int(getattr(scaler, "cur_hysteresis", 1) or 1),
        "skipped_steps": int(ds.model_states.get("skipped_steps", 0) or 0),
    }


def _rest(ds: DeepSpeedCheckpoint) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    module = ds.model_states["module"]
    trained = {n for g in ds.groups for n in g.names}
    shared = dict(ds.model_states.get("shared_params") or {})
    rest = {}
    for name, tensor in module.items():
        if name in trained or name in shared:
            continue
        if isinstance(tensor, torch.Tensor):
            rest[name] = tensor.detach().contiguous()
    aliases = {a: t for a, t in shared.items() if t in trained or t in rest}
    return rest, aliases


ENGINE_STATE_KEY = "flatzero_engine"
"""Key of the engine's counters in a checkpoint's ``extra`` (``flatzero.engine``'s)."""

_DS_MODEL_KEYS = {
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "shared_params",
    "frozen_param_fragments",
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "sparse_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "ds_config",
    "ds_version",
    "checkpoint_parallel_dimensions",
    "universal_checkpoint_info",
}


def _client_state(states: dict[str, Any]) -> dict[str, Any]:
    """The ``client_state`` a DeepSpeed user passed to ``save_checkpoint`` (JSON-able
    entries; DeepSpeed stores them beside its own keys)."""
    out = {}
    for key, value in states.items():
        if key in _DS_MODEL_KEYS:
            continue
        encoded = _json_or_none(value, f"client_state[{key!r}]")
        if encoded is not None or value is None:
            out[key] = encoded
    return out


def _json_or_none(value: Any, what: str) -> Any:
    try:
        return encode_value(value, what)
    except TypeError as error:
        logger.warning("not importing %s: %s", what, error)
        return None


def import_deepspeed(
    ds_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    out_tag: str | None = None,
    world_size: int | None = None,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    checksums: bool = True,
    overwrite: bool = False,
) -> Path:
    """Convert a DeepSpeed ZeRO-1/2 checkpoint into a flatzero checkpoint.

    The result loads with ``load_checkpoint`` at any world size, optimizer states
    included (fp32 masters, ``exp_avg``/``exp_avg_sq``/``step`` and the torch optimizer's
    hyperparameters, loss scale, LR scheduler state). DeepSpeed's ``global_steps``,
    ``global_samples`` and ``skipped_steps`` land in the checkpoint's ``extra``
    (``LoadResult.extra["deepspeed"]``).

    Args:
        ds_dir: DeepSpeed's checkpoint directory (with ``latest``) or one tag directory.
        out_dir: flatzero checkpoint directory to write into (``out_dir/<tag>``, ``latest``).
        tag: DeepSpeed tag to import; ``None`` follows ``latest``.
        out_tag: tag of the flatzero checkpoint; default DeepSpeed's.
        world_size: ranks of the written layout; default DeepSpeed's data-parallel size
            (any value loads at any world size; this only sets how many files).
        bucket_numel: bucket size of the written layout (elements).
        checksums: record crc32 checksums.
        overwrite: replace an existing flatzero checkpoint of that tag.

    Returns:
        The new checkpoint's path.
    """
    t0 = time.perf_counter()
    ds = read_deepspeed(ds_dir, tag)
    out_tag = check_tag(out_tag or ds.tag)
    ws = world_size or ds.world_size
    names = [n for g in ds.groups for n in g.names]
    specs = [
        [ParamSpec(n, s, ds.dtypes[n]) for n, s in zip(g.names, g.shapes, strict=True)]
        for g in ds.groups
    ]
    layout = plan_layout(specs, world_size=ws, bucket_numel=bucket_numel)
    index = ds.index()
    records = []
    for gl in layout.groups:
        gi = gl.group_index
        inner = ds.inner_state(0, gi)
        tensor_states = [k for k, v in inner.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        scalars = {
            k: encode_value(v, f"optimizer state {k!r}")
            for k, v in inner.items()
            if k not in tensor_states
        }
        hyper = {k: encode_value(v, f"hyperparameter {k!r}") for k, v in ds.hyperparams(gi).items()}
        records.append(GroupRecord((MASTER, *tensor_states), scalars, hyper))

    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / out_tag
    if final.exists() and not overwrite:
        raise ValueError(f"{final} already exists; choose another out_tag or pass overwrite=True")
    tmp = root / tmp_dir_name(out_tag, secrets.token_hex(6))
    tmp.mkdir()
    try:
        files = []
        for rank in range(ws):
            tensors = []
            for gi, plan in enumerate(plan_reads(index, layout, rank, where=str(ds.path))):
                for state in records[gi].states:
                    out = torch.zeros(plan.shard_numel, dtype=torch.float32)
                    execute(plan, out, ds.fetcher(state))
                    tensors.append((state_key(gi, state), out))
            files.append(
                write_rank_file(
                    tmp,
                    rank,
                    ws,
                    tensors,
                    layout_digest=layout.digest(),
                    tag=out_tag,
                    checksums=checksums,
                )
            )
        rest, aliases = _rest(ds)
        rest_file = None
        if rest:
            rest_file = write_tensors(
                tmp / MODEL_REST, list(rest.items()), {"format": "pt"}, checksums=checksums
            ).file
        states = ds.model_states
        accumulation = int((states.get("ds_config") or {}).get("gradient_accumulation_steps", 1))
        steps = int(states.get("global_steps") or 0)
        extra = {
            # The engine's counters, under the key flatzero's Engine reads them from.
            ENGINE_STATE_KEY: {
                "global_steps": steps,
                "global_samples": int(states.get("global_samples") or 0),
                "micro_steps": steps * max(1, accumulation),
                "skipped_steps": int(states.get("skipped_steps") or 0),
            },
            "client_state": _client_state(states),
            "deepspeed": {
                "tag": ds.tag,
                "world_size": ds.world_size,
                "stage": ds.stage,
                "global_steps": states.get("global_steps"),
                "global_samples": states.get("global_samples"),
                "skipped_steps": states.get("skipped_steps"),
                "ds_version": states.get("ds_version"),
                "clip_grad": ds.optim_state(0).get("clip_grad"),
            },
        }
        scheduler = states.get("lr_scheduler")
        meta = CheckpointMeta(
            tag=out_tag,
            layout=layout,
            groups=tuple(records),
            files=tuple(files),
            optimizer=None,
            stage=ds.stage,
            loss_scaler=_loss_scaler(ds),
            scheduler=_json_or_none(scheduler, "lr_scheduler") if scheduler else None,
            extra=_json_or_none(extra, "extra") or {},
            model_rest=rest_file,
            aliases=aliases,
            source=f"deepspeed {states.get('ds_version', '?')}",
            versions={"deepspeed": str(states.get("ds_version", "?")), "torch": torch.__version__},
        )
        meta.write(tmp / "meta.json")
        publish(tmp, final, overwrite=overwrite)
        write_latest(root, out_tag)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(
        "imported DeepSpeed ZeRO-%d checkpoint %s (%d ranks, %d params) as %s in %.1f s",
        ds.stage,
        ds.path,
        ds.world_size,
        len(names),
        final,
        time.perf_counter() - t0,
    )
    return final


# ---------------------------------------------------------------------------------- CLI
def add_import_deepspeed_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``flatzero import-deepspeed DS_DIR OUT_DIR``."""
    parser.add_argument("ds_dir", help="DeepSpeed checkpoint directory (with latest) or a tag")
    parser.add_argument("out_dir", help="flatzero checkpoint directory to write")
    parser.add_argument("--tag", default=None, help="DeepSpeed tag (default: its latest)")
    parser.add_argument("--out-tag", default=None, help="flatzero tag (default: DeepSpeed's)")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks of the written layout (default: DeepSpeed's; loads at any world size)",
    )
    parser.add_argument(
        "--bucket-numel",
        type=int,
        default=DEFAULT_BUCKET_NUMEL,
        help="bucket size of the written layout, in elements",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing tag")


def import_deepspeed_main(args: argparse.Namespace) -> int:
    """Run ``flatzero import-deepspeed``; returns the exit status."""
    try:
        path = import_deepspeed(
            args.ds_dir,
            args.out_dir,
            tag=args.tag,
            out_tag=args.out_tag,
            world_size=args.world_size,
            bucket_numel=args.bucket_numel,
            overwrite=args.overwrite,
        )
    except ValueError as error:
        print(f"flatzero import-deepspeed: error: {error}")
        return 1
    print(f"wrote flatzero checkpoint {path}")
    return 0
