"""``ShardedOptimizerState``: what a ``ZeroOptimizer`` hands to checkpoints and takes back.

One rank's shard of the optimizer, typed: per layout group the fp32 master shard, the
inner optimizer's state of it and its hyperparameters; the loss scaler and the learned
bucket order. ``ZeroOptimizer.sharded_state()`` produces it and
``ZeroOptimizer.load_sharded_state()`` consumes it; checkpoints read and write it
(``flatzero.checkpoint.optimizer_state``); ``state_dict()``/``load_state_dict()`` are its
torch-style dict form (``to_state_dict``/``from_state_dict``), the only place that knows
that form's keys.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .inner import needs_whole_params
from .scaler import LossScaler

__all__ = ["STATE_DICT_FORMAT", "GroupState", "ShardedOptimizerState", "check_loadable"]

STATE_DICT_FORMAT = "flatzero.ZeroOptimizer/1"
"""The ``"format"`` entry of ``ZeroOptimizer.state_dict()``."""


def _is_per_element(value: Any) -> bool:
    """Whether an inner-optimizer state value is per element (a tensor of one or more
    dimensions, sharded like the master) rather than a scalar (``step``, ...)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


@dataclass(frozen=True)
class GroupState:
    """One layout group's optimizer state on this rank. Tensors are references.

    Attributes:
        master: this rank's fp32 master shard (1-D, the group's shard length in elements).
        state: the inner optimizer's state of the shard, as torch keeps it and in its
            order: per-element tensors of the master's length (``exp_avg``, ...) and
            scalars (``step``: a 0-d tensor or a number). Empty before the first step.
        options: the inner optimizer's hyperparameters of the group (``lr``, ``betas``,
            ...: its param group without ``params``).
    """

    master: torch.Tensor
    state: Mapping[str, Any]
    options: Mapping[str, Any]

    @property
    def shards(self) -> dict[str, torch.Tensor]:
        """The per-element states, in the optimizer's order."""
        return {k: v for k, v in self.state.items() if _is_per_element(v)}

    @property
    def scalars(self) -> dict[str, Any]:
        """The other states (``step``, ...), in the optimizer's order."""
        return {k: v for k, v in self.state.items() if not _is_per_element(v)}


@dataclass(frozen=True)
class ShardedOptimizerState:
    """This rank's shard of a ``ZeroOptimizer``, for checkpoints and state dicts.

    Attributes:
        layout_digest: ``Layout.digest()`` of the layout the shards belong to.
        world_size: ranks the state is sharded over.
        rank: the rank whose shard this is.
        stage: the ZeRO stage (1 or 2).
        groups: one ``GroupState`` per layout group, in layout order.
        loss_scaler: ``LossScaler.state_dict()``, or None without loss scaling.
        bucket_order: the order in which the optimizer launches its bucket reductions
            (learned from backward; bucket numbers over all groups), or None.
        optimizer: the inner optimizer's class name (``"AdamW"``); None when read from a
            state dict, which does not record it.
    """

    layout_digest: str
    world_size: int
    rank: int
    stage: int
    groups: tuple[GroupState, ...]
    loss_scaler: Mapping[str, Any] | None = None
    bucket_order: tuple[int, ...] | None = None
    optimizer: str | None = None

    @property
    def step(self) -> int | None:
        """The inner optimizer's ``step`` of the first group that has one, else None."""
        for group in self.groups:
            if "step" in group.state:
                value = group.state["step"]
                return int(value.item() if isinstance(value, torch.Tensor) else value)
        return None

    def inner_state_dict(self) -> dict[str, Any]:
        """The inner optimizer's ``state_dict()`` form (its group ``i`` holds param ``i``:
        the master shard of layout group ``i``)."""
        return {
            "state": {i: dict(g.state) for i, g in enumerate(self.groups) if g.state},
            "param_groups": [{**g.options, "params": [i]} for i, g in enumerate(self.groups)],
        }

    def to_state_dict(self) -> dict[str, Any]:
        """``ZeroOptimizer.state_dict()``'s form (``STATE_DICT_FORMAT``)."""
        return {
            "format": STATE_DICT_FORMAT,
            "layout_digest": self.layout_digest,
            "world_size": self.world_size,
            "rank": self.rank,
            "stage": self.stage,
            "master": [g.master for g in self.groups],
            "optimizer": self.inner_state_dict(),
            "loss_scaler": dict(self.loss_scaler) if self.loss_scaler is not None else None,
            "bucket_order": list(self.bucket_order) if self.bucket_order is not None else None,
        }

    @classmethod
    def from_state_dict(cls, state_dict: Any) -> ShardedOptimizerState:
        """Parse ``to_state_dict()``'s output (tensors stay references).

        Raises:
            ValueError: not such a state dict, or its entries do not fit together.
        """
        if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_DICT_FORMAT:
            raise ValueError(
                "not a ZeroOptimizer state dict (its 'format' entry is not "
                f"{STATE_DICT_FORMAT!r}); pass the output of ZeroOptimizer.state_dict()"
            )
        masters = state_dict.get("master")
        if not isinstance(masters, (list, tuple)):
            raise ValueError("the state dict has no 'master' entry (a list of master shards)")
        inner = state_dict.get("optimizer")
        if not isinstance(inner, dict) or "param_groups" not in inner or "state" not in inner:
            raise ValueError("the state dict has no valid 'optimizer' entry")
        if len(inner["param_groups"]) != len(masters):
            raise ValueError(
                f"the state dict's optimizer has {len(inner['param_groups'])} param groups "
                f"but {len(masters)} master shards"
            )
        for key in inner["state"]:
            if not isinstance(key, int) or not 0 <= key < len(masters):
                raise ValueError(f"the state dict's optimizer state has an unknown key {key!r}")
        groups = tuple(
            GroupState(
                master,
                dict(inner["state"].get(i, {})),
                {k: v for k, v in options.items() if k != "params"},
            )
            for i, (master, options) in enumerate(zip(masters, inner["param_groups"], strict=True))
        )
        order = state_dict.get("bucket_order")
        return cls(
            layout_digest=state_dict.get("layout_digest"),
            world_size=state_dict.get("world_size"),
            rank=state_dict.get("rank"),
            stage=state_dict.get("stage"),
            groups=groups,
            loss_scaler=state_dict.get("loss_scaler"),
            bucket_order=tuple(int(i) for i in order) if order is not None else None,
        )


def check_loadable(state: ShardedOptimizerState, mine: ShardedOptimizerState) -> None:
    """Raise ``ValueError`` unless ``state`` can be loaded by the optimizer whose current
    state is ``mine``: the same layout and rank, shards of its lengths, and a loss scaler
    state when it scales the loss."""
    if state.layout_digest != mine.layout_digest:
        raise ValueError(
            f"the state dict was saved with another layout (world size {state.world_size}; "
            f"this optimizer has world size {mine.world_size}), or for other params, groups, "
            "dtypes or bucket size. A shard can only be loaded into the same layout; load a "
            "checkpoint at another world size with flatzero's checkpoint loader, which reshards"
        )
    if state.rank != mine.rank:
        raise ValueError(
            f"the state dict holds rank {state.rank}'s shard but this is rank {mine.rank}; "
            "every rank must load its own shard"
        )
    if len(state.groups) != len(mine.groups):
        raise ValueError(
            f"the state dict has {len(state.groups)} master shards; this optimizer has "
            f"{len(mine.groups)}"
        )
    for i, (saved, own) in enumerate(zip(state.groups, mine.groups, strict=True)):
        if not isinstance(saved.master, torch.Tensor) or saved.master.shape != own.master.shape:
            raise ValueError(
                f"master shard {i} in the state dict has shape "
                f"{getattr(saved.master, 'shape', None)}; expected {tuple(own.master.shape)}"
            )
        for name, item in saved.shards.items():
            if item.numel() != own.master.numel():
                raise ValueError(
                    f"optimizer state {name!r} of group {i} has {item.numel()} elements; "
                    f"this rank's shard has {own.master.numel()}"
                )
    # A fixed scale (no iteration counts) loads a state without a scaler as it is: fp32 and
    # bf16 checkpoints written before their steps were checked for inf/nan have none.
    if mine.loss_scaler is not None and (
        state.loss_scaler is not None or "iteration" in mine.loss_scaler
    ):
        LossScaler.check_state_dict(state.loss_scaler)


_DEVICE_OPTIONS = ("params", "param_names", "fused", "foreach", "capturable", "differentiable")
"""Group keys a probe on a host tensor leaves out (they depend on the device, or are not
hyperparameters)."""


def check_options(cls: type, state: ShardedOptimizerState) -> None:
    """Raise ``ValueError`` unless ``cls`` accepts every group's hyperparameters in
    ``state`` (``lr=-1``, one beta, ...: ``load_state_dict`` of torch's optimizers takes
    them unchecked): each is passed to ``cls``'s constructor over a throwaway param."""
    accepted = inspect.signature(cls.__init__).parameters
    for i, group in enumerate(state.groups):
        kwargs = {
            k: v for k, v in group.options.items() if k in accepted and k not in _DEVICE_OPTIONS
        }
        try:
            shape = (1, 1) if needs_whole_params(cls) else (1,)
            cls([torch.nn.Parameter(torch.zeros(shape))], **kwargs)
        except (ValueError, TypeError, IndexError, KeyError) as error:
            raise ValueError(
                f"param group {i} of the state dict has hyperparameters {cls.__name__} refuses "
                f"({type(error).__name__}: {error}); load a state dict this optimizer saved"
            ) from None
