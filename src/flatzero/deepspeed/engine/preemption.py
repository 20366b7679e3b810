"""The DeepSpeed door's save on a signal: the ``flatzero`` section's ``preemption_*`` keys.

``engine_watch`` installs the handlers when ``preemption_dir`` is set
(``checkpoint.preemption``); ``check_at_boundary`` runs at the end of every boundary
``engine.step()``: once the ranks agree that one got a signal, every rank saves the step just
taken with ``engine.save_checkpoint(preemption_dir)`` (DeepSpeed's tag ``global_step<N>``,
``latest`` moved, the engine's counters and the scheduler as after this step), waits for it,
and ``Preempted`` is raised out of ``engine.step()``. The Hugging Face route calls
``engine.step()`` inside ``accelerator.backward``, so the same keys serve it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from ...checkpoint.preemption import PreemptionConfig, SignalWatch
from .config.schema import FlatzeroSection

__all__ = ["check_at_boundary", "engine_watch"]


def engine_watch(section: FlatzeroSection, group: dist.ProcessGroup | None) -> SignalWatch | None:
    """The installed ``SignalWatch`` of the section's ``preemption_*`` keys, or None when
    ``preemption_dir`` is not set."""
    if section.preemption_dir is None:
        return None
    config = PreemptionConfig(
        directory=section.preemption_dir,
        signals=tuple(s.strip() for s in section.preemption_signals.split(",") if s.strip()),
        grace_s=float(section.preemption_grace_s),
        check_every=section.preemption_check_every,
        exit_code=section.preemption_exit_code,
    )
    return SignalWatch(config, group).install()


def check_at_boundary(watch: SignalWatch, engine: Any) -> None:
    """(Every rank, at the end of a boundary ``engine.step()``.) Save and raise
    ``Preempted`` once the ranks agree that a signal came."""
    agreed = watch.agree()
    if agreed is None:
        return

    def save() -> Path:
        directory = watch.config.directory
        tag = f"global_step{engine.global_steps}"
        engine.save_checkpoint(directory, tag=tag)
        engine.wait_for_save()
        return Path(directory) / tag

    raise watch.preempt(*agreed, save)
