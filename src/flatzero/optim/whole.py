"""``WholeParamsOptimizer``: an optimizer that needs whole tensors, stepping a flat shard.

With ``FlattenConfig.whole_params`` every param lies whole in one rank's slice
(``flatzero.owners``), so this rank's master shard holds whole params. The wrapped
optimizer (torch's ``Muon``, ``Adafactor``) steps 2-D views of the master shard, each the
shape of its param, with the matching views of the gradient shard: each matrix is stepped
by its owner alone, exactly once per step over all ranks.

A group stepped elementwise (``DeepSpeedMuon``'s Adam half, laid out in flat slices) gets
one piece: the whole shard as one 1-D tensor, so the wrapped optimizer steps it as it would
under a plain ``ZeroOptimizer``.

To the rest of flatzero it looks like an elementwise optimizer over one flat param per
group: ``param_groups[i]["params"] == [master shard i]``, and ``state[master]`` holds one
flat tensor of the shard's length per per-element state (Muon's ``momentum_buffer``),
whose pieces are the wrapped optimizer's own state tensors (views), so checkpoints save,
load and reshard it as they do Adam's moments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["WholeParamsOptimizer", "WholePiece"]


@dataclass(frozen=True)
class WholePiece:
    """A whole param inside this rank's master shard.

    Attributes:
        start: its first element in the shard.
        shape: its shape.
    """

    start: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """The piece's view of a shard-long flat tensor, shaped like the param."""
        return flat[self.start : self.start + self.numel].view(self.shape)


_PLACEHOLDER_SHAPE = (1, 1)
"""Shape of the never-stepped stand-in of a group with no whole param on this rank (the
wrapped optimizer refuses an empty group; Muon refuses a param that is not 2-D)."""


class WholeParamsOptimizer(torch.optim.Optimizer):
    """Steps whole params, as views of flat master shards, with an optimizer that needs
    whole tensors.

    Args:
        optimizer: the wrapped class (or a ``functools.partial`` of one).
        shards: one fp32 master shard per group (``nn.Parameter``, ``.grad`` set).
        group_options: per group, the user's hyperparameters.
        defaults: the wrapped optimizer's keyword arguments.
        pieces: per group, the whole params this rank owns (a group stepped elementwise:
            one 1-D piece, the whole shard); ``None`` (a probe on stand-ins): none.
    """

    def __init__(
        self,
        optimizer: Callable[..., torch.optim.Optimizer],
        shards: Sequence[torch.nn.Parameter],
        group_options: Sequence[dict[str, Any]],
        defaults: dict[str, Any],
        pieces: Sequence[Sequence[WholePiece]] | None = None,
    ) -> None:
        pieces = pieces or [()] * len(shards)
        self._pieces = [tuple(p) for p in pieces]
        self._shards = list(shards)
        self._views = [
            [piece.of(shard.detach()) for piece in group]
            for shard, group in zip(shards, self._pieces, strict=True)
        ]
        wrapped_groups = [
            {**options, "params": views or [torch.zeros(_PLACEHOLDER_SHAPE, device=s.device)]}
            for options, views, s in zip(group_options, self._views, shards, strict=True)
        ]
        self.wrapped = optimizer(wrapped_groups, **defaults)
        """The wrapped optimizer over this rank's whole params."""
        self.whole_class: type = type(self.wrapped)
        """The wrapped optimizer's class (checkpoints record its name)."""
        self._names = self._probe_per_element_names()
        """Per group, the names of the wrapped optimizer's per-element states."""
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [shard]}
            for g, shard in zip(self.wrapped.param_groups, shards, strict=True)
        ]
        super().__init__(groups, dict(self.wrapped.defaults))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Step every whole param this rank owns with the wrapped optimizer."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, wrapped in zip(self.param_groups, self.wrapped.param_groups, strict=True):
            wrapped.update({k: v for k, v in group.items() if k != "params"})  # lr schedules
        self._link_grads()
        self.wrapped.step()
        self._home_state()
        return loss

    def _link_grads(self) -> None:
        """Each view's ``.grad``: the matching view of its shard's gradient."""
        for shard, group, views in zip(self._shards, self._pieces, self._views, strict=True):
            for piece, view in zip(group, views, strict=True):
                view.grad = None if shard.grad is None else piece.of(shard.grad)

    # [Note: updates before the norm] DeepSpeed's ZeRO optimizer replaces each Muon
    # matrix's gradient by its orthogonalized update before it takes the global norm, so
    # its gradient clipping (on by default, 1.0) scales the updates. ``ZeroOptimizer.step``
    # calls this before the norm when its inner optimizer has it (the gradients are then
    # the shards the norm reads); with optimizer offload the inner optimizer would step
    # host copies made before, so ``prepare._probe`` refuses ``DeepSpeedMuon`` with it.
    @torch.no_grad()
    def grads_to_updates(self, scale: float) -> None:
        """The wrapped optimizer's ``grads_to_updates`` (DeepSpeed's Muon: each matrix's
        gradient replaced by its update before the norm and clipping), when it has one;
        the gradients are ``1 / scale`` times the averaged, unscaled gradient."""
        to_updates = getattr(self.wrapped, "grads_to_updates", None)
        if to_updates is None:
            return
        self._link_grads()
        to_updates(scale)
        self._home_state()

    def _home_state(self) -> None:
        """Give each per-element state of the wrapped optimizer (a tensor shaped like its
        param) a home in one flat tensor per group and name, so that ``state[shard]`` is
        the shard's state: the wrapped tensors become views of the flat one. Every group
        gets every name of its kind (``_probe_per_element_names``), zeros where this rank
        owns nothing: every rank saves the same names."""
        for shard, group, views, names in zip(
            self._shards, self._pieces, self._views, self._names, strict=True
        ):
            flat_state = self.state[shard]
            for name in names:
                if name not in flat_state:
                    flat_state[name] = torch.zeros(
                        shard.numel(), dtype=shard.dtype, device=shard.device
                    )
            for piece, view in zip(group, views, strict=True):
                own = self.wrapped.state.get(view, {})
                for name, value in own.items():
                    if name in names and _per_element(value, view):
                        target = piece.of(flat_state[name])
                        if value.data_ptr() != target.data_ptr():
                            target.copy_(value)
                            own[name] = target
                    elif not isinstance(value, torch.Tensor) or value.dim() == 0:
                        flat_state[name] = value  # a scalar (step, ...): equal on every param

    def _probe_per_element_names(self) -> list[tuple[str, ...]]:
        """Per group, the names of the wrapped optimizer's per-element states, from one
        step of its class on a throwaway 2-by-2 param per group, with the group's options
        (at construction, not in a training step)."""
        probes = [torch.zeros(2, 2) for _ in self.wrapped.param_groups]
        for param in probes:
            param.grad = torch.zeros(2, 2)
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [param]}
            for g, param in zip(self.wrapped.param_groups, probes, strict=True)
        ]
        probe = self.whole_class(groups)
        probe.step()
        return [
            tuple(n for n, value in probe.state[param].items() if _per_element(value, param))
            for param in probes
        ]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()``'s form: hyperparameters, and the flat states copied into
        the wrapped optimizer's per-param state."""
        super().load_state_dict(state_dict)
        for shard, group, views in zip(self._shards, self._pieces, self._views, strict=True):
            flat_state = self.state.get(shard, {})
            for piece, view in zip(group, views, strict=True):
                own = self.wrapped.state[view]
                own.clear()
                for name, value in flat_state.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        own[name] = piece.of(value)
                    else:
                        own[name] = value
        for group, wrapped in zip(self.param_groups, self.wrapped.param_groups, strict=True):
            wrapped.update({k: v for k, v in group.items() if k != "params"})

    def state_dict(self) -> dict[str, Any]:
        """The flat form (``torch.optim``'s, over the master shards).

        Raises:
            ValueError: the wrapped optimizer keeps state that is neither per element nor
                a scalar (Adafactor's factored row and column moments), which a sharded
                checkpoint cannot hold yet.
        """
        for views in self._views:
            for view in views:
                for name, value in self.wrapped.state.get(view, {}).items():
                    tensor = isinstance(value, torch.Tensor) and value.dim() > 0
                    if tensor and not _per_element(value, view):
                        raise ValueError(
                            f"{self.whole_class.__name__} keeps state {name!r} of shape "
                            f"{tuple(value.shape)} for a param of shape {tuple(view.shape)}; "
                            "flatzero's sharded state holds only per-element state and "
                            "scalars, so this optimizer's state cannot be saved"
                        )
        return super().state_dict()


def _per_element(value: Any, view: torch.Tensor) -> bool:
    """Whether a state value is per element of its param (same shape)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == view.shape
