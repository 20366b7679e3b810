"""``zero_optimization.ignore_unused_parameters: false``: every trainable param must get a
gradient in each accumulation window, as DeepSpeed's offloaded ZeRO-1/2 asserts.

DeepSpeed 0.19.8 checks this only with optimizer offload (its other paths zero-fill, as
flatzero always does), so the engine makes the check only there
(``ZeroSection.check_unused``). A hook per param notes that a gradient arrived; at the
step every rank learns whether any rank missed one (one all-reduce on the control group,
this opt-in mode only) and all raise ``AssertionError`` (DeepSpeed's type) naming the
params of the rank that missed them, instead of one rank raising while the others wait in
the step's collectives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ...comm import all_reduce_max
from ...own_groups import control_group
from ...words import plural

__all__ = ["UnusedCheck"]


class UnusedCheck:
    """Notes which trainable params got a gradient since the last step."""

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]]) -> None:
        self._names = [name for name, _ in named]
        self._seen = [False] * len(named)
        self._handles = [param.register_hook(self._marker(i)) for i, (_, param) in enumerate(named)]

    def _marker(self, index: int):
        def mark(grad: torch.Tensor) -> None:
            self._seen[index] = True

        return mark

    def verify(self, group: dist.ProcessGroup | None) -> None:
        """(At the step; collective on the control group of ``group``.) Raise
        ``AssertionError`` on every rank when any rank's params missed a gradient in this
        window; then start a new window."""
        missing = [name for name, seen in zip(self._names, self._seen, strict=True) if not seen]
        self._seen = [False] * len(self._names)
        if not all_reduce_max(int(bool(missing)), control_group(group)):
            return
        shown = ", ".join(missing[:8]) + (", ..." if len(missing) > 8 else "")
        where = (
            f"{plural(len(missing), 'trainable param')} got no gradient in this accumulation "
            f"window ({shown})"
            if missing
            else "another rank's trainable params got no gradient in this window (see its error)"
        )
        raise AssertionError(
            f"{where}, and zero_optimization.ignore_unused_parameters is false (with optimizer "
            "offload DeepSpeed checks this too): set it to true to train them as zero "
            "gradients, or make every param take part in the loss"
        )

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
