"""Reading a DeepSpeed ZeRO-1/2 checkpoint without DeepSpeed: where each param's elements lie.

See the note beside the file names.
"""

from __future__ import annotations

import os
import re
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.format import MASTER
from ..checkpoint.reshard import ParamRecord, index_layout
from ..dtypes import dtype_name
from ..layout import Layout, ParamSpec
from . import pickle as ds_pickle
from .layout import MODEL_STATES, deepspeed_layout
from .muon_state import MOMENTUM, is_muon_group, momentum_to_partition

__all__ = ["DeepSpeedCheckpoint", "read_deepspeed"]

# [Note: what DeepSpeed writes, and how it is read.
# What DeepSpeed (0.19.x) writes for ZeRO stage 1 and 2, data parallel only, in
# ``DS_DIR/<tag>/`` (``DS_DIR/latest`` holds the tag):
#
# - ``mp_rank_00_model_states.pt``: ``module`` (the full model state dict in the training
#   dtype), ``param_shapes`` (per optimizer group, an ordered ``{name: shape}`` in the order
#   of the group's flat buffer), ``buffer_names``, ``frozen_param_shapes``,
#   ``shared_params`` (tied names), ``lr_scheduler``, ``global_steps``, ``ds_config``, ...
# - per data-parallel rank ``r``, ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (prefixed
#   ``bf16_`` with bf16): ``optimizer_state_dict`` with ``single_partition_of_fp32_groups``
#   (per group, rank ``r``'s fp32 partition, trailing padding stripped or not),
#   ``base_optimizer_state`` (the torch optimizer's ``state_dict()`` whose state ``i`` is
#   group ``i``'s partition: ``exp_avg``, ``exp_avg_sq``, ``step``; a list of per-group
#   states with ``elastic_checkpoint``), ``partition_count``, ``group_paddings``,
#   ``param_alignment_paddings`` (padding after each param, 0.19+), ``loss_scaler``.
#
# Each group's params are concatenated in ``param_shapes`` order (plus any per-param
# alignment padding), the whole padded to a multiple of ``2 * world_size`` elements, and cut
# into ``world_size`` equal partitions (``deepspeed_layout``). This module derives, per
# param, which ranks' partitions hold which of its elements (``DeepSpeedCheckpoint.index``)
# and reads only the needed slices of the memory-mapped files
# (``DeepSpeedCheckpoint.fetcher``). DeepSpeed itself is not needed, and nothing in the
# files runs: they are read with torch's ``weights_only`` unpickler, DeepSpeed's few pickled
# classes as inert records (``deepspeed_pickle``); anything else is refused.]
_OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


# --------------------------------------------------------------------------- reading
@dataclass
class DeepSpeedCheckpoint:
    """A DeepSpeed ZeRO-1/2 checkpoint, opened (files memory-mapped).

    Attributes:
        path: the tag directory.
        tag: its tag.
        world_size: data-parallel ranks it was saved by.
        stage: ZeRO stage (1 or 2).
        layout: DeepSpeed's flat partitions (``deepspeed_layout``): group ``i`` holds
            optimizer group ``i``'s params in flat order (their trained dtypes), rank
            ``r``'s shard is its partition.
        model_states: the contents of ``mp_rank_00_model_states.pt``.
        optim_files: per rank, its optimizer-state file.
    """

    path: Path
    tag: str
    world_size: int
    stage: int
    layout: Layout
    model_states: dict[str, Any]
    optim_files: list[Path]
    _optim: dict[int, dict[str, Any]]

    @property
    def param_names(self) -> set[str]:
        """Names of the params in the optimizer groups."""
        return {s.spec.name for g in self.layout.groups for s in g.slots}

    def optim_state(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s ``optimizer_state_dict`` (loaded once, memory-mapped)."""
        if rank not in self._optim:
            data = ds_pickle.load(self.optim_files[rank])
            sd = data.get("optimizer_state_dict") if isinstance(data, dict) else None
            if not isinstance(sd, dict) or "single_partition_of_fp32_groups" not in sd:
                raise ValueError(
                    f"{self.optim_files[rank]} has no ZeRO-1/2 optimizer state "
                    "(optimizer_state_dict.single_partition_of_fp32_groups); it was not "
                    "written by a DeepSpeed ZeRO stage 1 or 2 optimizer"
                )
            self._check_partitions(rank, sd)
            self._partition_muon(rank, sd)
            self._optim[rank] = sd
        return self._optim[rank]

    def _partition_muon(self, rank: int, sd: dict[str, Any]) -> None:
        """Give each Muon group's ``momentum_buffer`` (whole params, ``muon_state``) the
        partition's length, as every other per-element state has."""
        base = sd.get("base_optimizer_state")
        if not isinstance(base, dict) or "state" not in base:
            return
        for gi, group in enumerate(base.get("param_groups") or []):
            state = base["state"].get(gi) or {}
            momentum = state.get(MOMENTUM)
            if is_muon_group(group) and isinstance(momentum, torch.Tensor):
                try:
                    state[MOMENTUM] = momentum_to_partition(self.layout.groups[gi], rank, momentum)
                except ValueError as error:
                    raise ValueError(f"{self.optim_files[rank]}: {error}") from None

    def close_files(self) -> None:
        """Drop every rank's optimizer state read so far: their memory-mapped files close
        and their pages leave this process's memory (``optim_state`` opens a file again
        when asked)."""
        self._optim.clear()

    def _check_partitions(self, rank: int, sd: dict[str, Any]) -> None:
        parts = sd["single_partition_of_fp32_groups"]
        groups = self.layout.groups
        if len(parts) != len(groups):
            raise ValueError(
                f"{self.optim_files[rank]} has {len(parts)} fp32 partitions but "
                f"{MODEL_STATES} describes {len(groups)} groups"
            )
        paddings = sd.get("group_paddings") or [0] * len(parts)
        for gi, (part, group) in enumerate(zip(parts, groups, strict=True)):
            n = part.numel()
            if n != group.shard_numel and n + paddings[gi] != group.shard_numel:
                raise ValueError(
                    f"{self.optim_files[rank]}: group {gi}'s fp32 partition has {n} elements; "
                    f"the param shapes give partitions of {group.shard_numel}. The files "
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
        return index_layout(self.layout)

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
    if tag is None and (ds_dir / MODEL_STATES).is_file():
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
    if not (path / MODEL_STATES).is_file():
        if list(path.glob("zero_pp_rank_*_mp_rank_00_model_states.pt")):
            raise ValueError(
                f"{path} is a ZeRO stage 3 checkpoint (per-rank model states); only ZeRO stage "
                "1 and 2 checkpoints can be imported"
            )
        raise ValueError(
            f"{path / MODEL_STATES} does not exist: not a DeepSpeed ZeRO-1/2 checkpoint of "
            "a data-parallel (not tensor- or pipeline-parallel) run"
        )
    return tag, path


def _model_states(path: Path) -> dict[str, Any]:
    """``mp_rank_00_model_states.pt``, checked to come from a data-parallel ZeRO-1/2 run."""
    model_path = path / MODEL_STATES
    states = ds_pickle.load(model_path)
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
    return states


def _optim_files(path: Path, states: dict[str, Any]) -> list[Path]:
    """Every data-parallel rank's optimizer-state file, in rank order."""
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
    return [files[r] for r in range(world_size)]


def _layout(states: dict[str, Any], first: dict[str, Any], world_size: int) -> Layout:
    """DeepSpeed's flat partitions: each group's params in flat order (``param_shapes``),
    with their trained dtypes and alignment paddings."""
    module = states["module"]
    paddings = first.get("param_alignment_paddings") or []
    groups, pads = [], []
    for gi, shapes in enumerate(states["param_shapes"]):
        specs = []
        for name, shape in shapes.items():
            tensor = module.get(name)
            dtype = dtype_name(tensor.dtype) if isinstance(tensor, torch.Tensor) else "float32"
            specs.append(ParamSpec(name, tuple(int(d) for d in shape), dtype))
        groups.append(specs)
        pads.append([int(p) for p in paddings[gi]] if gi < len(paddings) else [0] * len(specs))
    return deepspeed_layout(groups, world_size, pads)


def _stage(path: Path, states: dict[str, Any], first: dict[str, Any]) -> int:
    """The ZeRO stage (1 or 2), from rank 0's optimizer state or the DeepSpeed config."""
    stage = first.get("zero_stage")
    if stage is None:
        ds_config = states.get("ds_config") or {}
        stage = int(ds_config.get("zero_optimization", {}).get("stage", 0) or 0)
    if stage not in (1, 2):
        raise ValueError(f"{path}: ZeRO stage {stage!r}; only stages 1 and 2 can be imported")
    return int(stage)


def read_deepspeed(ds_dir: str | os.PathLike[str], tag: str | None = None) -> DeepSpeedCheckpoint:
    """Open a DeepSpeed ZeRO-1/2 checkpoint (``DS_DIR`` with ``latest``, or a tag dir).

    Raises:
        ValueError: not a ZeRO-1/2 data-parallel checkpoint, missing rank files, or files
            that disagree (each error names the file).
    """
    tag, path = _resolve_ds_tag(Path(ds_dir), tag)
    states = _model_states(path)
    files = _optim_files(path, states)
    first = ds_pickle.load(files[0]).get("optimizer_state_dict", {})
    layout = _layout(states, first, len(files))
    stage = _stage(path, states, first)
    ckpt = DeepSpeedCheckpoint(path, tag, len(files), stage, layout, states, files, {})
    ckpt._check_partitions(0, first)
    ckpt._partition_muon(0, first)
    ckpt._optim[0] = first
    return ckpt
