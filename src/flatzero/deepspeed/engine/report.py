"""``EngineInitReport``: what ``flatzero.initialize`` did on this rank."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ...report import InitReport, fit
from ...words import plural

__all__ = ["EngineInitReport"]


@dataclass(frozen=True)
class EngineInitReport:
    """What ``flatzero.initialize`` did on this rank.

    Attributes:
        flatten: the flatten report (tier, phases, bytes moved, peak memory, the rank's
            core share and the threads init ran with).
        stage: ZeRO stage (0, 1, 2).
        dtype: training dtype of the params (``"bf16"``, ``"fp16"``, ``"fp32"``).
        world_size: data-parallel ranks.
        rank: this rank.
        params: trainable elements.
        tensors: trainable tensors (tied weights once).
        optimizer: the inner ``torch.optim`` class and where it came from (config, client).
        scheduler: the LR scheduler's class name, or None.
        source: where the weights came from (``"cpu"``, ``"cuda:0"``, ``"meta+safetensors"``,
            ``"meta+checkpoint"``) and in which dtype(s).
        param_sync: what made the ranks' initial weights equal (``"gather"``,
            ``"broadcast"``, ``"check"``, ``"none"``, or why nothing was needed).
        phase_seconds: wall seconds of each phase of ``initialize`` (config, flatten, sync,
            optimizer, scheduler).
        wall_seconds: wall seconds of the whole ``initialize`` call.
        ignored_keys: config keys accepted without effect.
    """

    flatten: InitReport
    stage: int
    dtype: str
    world_size: int
    rank: int
    params: int
    tensors: int
    optimizer: str
    scheduler: str | None
    source: str
    param_sync: str
    phase_seconds: dict[str, float] = field(default_factory=dict)
    wall_seconds: float = 0.0
    ignored_keys: tuple[str, ...] = ()

    @property
    def tiers(self) -> tuple[str, ...]:
        """The flatten tier of each group."""
        return self.flatten.tiers

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form."""
        return asdict(self)

    def summary(self) -> str:
        """The report for a human: a headline, then one line per fact (the flatten
        report's facts among them), each line under ``LINE_WIDTH`` characters."""
        phases = ", ".join(f"{k} {v:.3f}s" for k, v in self.phase_seconds.items())
        lines = [
            f"flatzero.initialize {self.wall_seconds:.3f}s: ZeRO stage {self.stage}, "
            f"{self.dtype}, {plural(self.world_size, 'rank')}, {self.params / 1e6:.2f}M params "
            f"in {plural(self.tensors, 'tensor')}",
            f"weights from: {self.source}",
            f"phases: {phases}",
            f"flatten {self.flatten.wall_seconds:.3f}s:",
            *(f"  {fact}" for fact in self.flatten.facts()),
            f"weights agreed by: {self.param_sync}",
            f"optimizer: {self.optimizer}",
            f"scheduler: {self.scheduler or 'none'}",
        ]
        if self.ignored_keys:
            lines.append(f"config keys without effect: {', '.join(self.ignored_keys)}")
        return fit([lines[0], *(f"  {line}" for line in lines[1:])])
