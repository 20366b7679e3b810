"""Save on a signal (opt-in): every rank saves the same step after SIGTERM or SIGUSR1, then exits.

Kubernetes sends SIGTERM and kills ``terminationGracePeriodSeconds`` later; Slurm sends the
signal ``--signal`` names some seconds before the time limit (to every process of the step,
torchrun and the workers alike, and torchrun forwards it: the workers get it twice);
torchrun kills its workers 30 s after it forwards one. ``SignalWatch.install`` sets, for
each signal of ``PreemptionConfig.signals``, a handler that only notes when the signal came
(a second signal notes nothing new and interrupts nothing: an asynchronous save being
written goes on). At a step boundary every ``check_every`` steps the ranks agree
(``SignalWatch.agree``: one all-reduce of one scalar on the control group, gloo on the host,
so no device sync; [Note: why every step]) and, if any rank got a signal, every rank saves
the same step into ``PreemptionConfig.directory`` (``latest`` names it), waits for the save,
and raises ``Preempted``: a ``SystemExit``, so that uncaught it ends the process with
``exit_code`` (default ``128 + the signal's number``, what a shell reports for a process
that the signal ended: a scheduler or a Kubernetes Job sees "terminated", not "finished"),
while a script can catch it. The DeepSpeed door checks in ``engine.step()`` (the
``flatzero`` section's ``preemption_*`` keys; the Hugging Face route too); the PyTorch door
in ``ZeroOptimizer.step()`` (``save_on_signal``).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..comm import world_size_of
from ..optim import ZeroOptimizer
from ..own_groups import control_group
from .checkpointer import wait_for_save
from .format import read_latest
from .save import save_checkpoint

__all__ = ["Preempted", "PreemptionConfig", "SignalWatch", "save_on_signal"]

logger = logging.getLogger(__name__)

# [Note: why every step]
# The agreement is one gloo all-reduce of one int64 on the host (about 0.1 ms at 2 ranks on
# one host; a network round trip across hosts). It needs no device sync: the tensor is a
# host tensor and the control group never queues behind GPU work; the hosts meet, which the
# step's collectives already make them do, a step later at most. So the default is every
# step (``check_every=1``): the save then starts at most one step after the signal, which
# matters when the grace period is a few steps long. Piggybacking the flag on the step's
# own gradient-norm all-reduce would save that round trip but run on the device group and
# tie the signal to the optimizer's internals; ``check_every`` > 1 divides the cost where
# steps are shorter than a few milliseconds.


@dataclass(frozen=True)
class PreemptionConfig:
    """Opt-in save on a signal.

    Attributes:
        directory: where the preemption checkpoint goes (``latest`` names it).
        signals: the signals that ask for it, by name.
        grace_s: seconds between the signal and the kill (Kubernetes'
            ``terminationGracePeriodSeconds``, Slurm's ``--signal=...@<seconds>``, torchrun's
            30 s after it forwards a signal: the least of them); a save that starts later
            than this after the signal is logged as likely to be killed (the previous
            checkpoint stays ``latest``), and the log says how much of it was used.
        check_every: steps between the ranks' agreements (1: every step).
        exit_code: the status ``Preempted`` ends the process with (None: 128 + the number
            of the signal that came first).
    """

    directory: str
    signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    grace_s: float = 30.0
    check_every: int = 1
    exit_code: int | None = None

    def __post_init__(self) -> None:
        if not self.directory:
            raise ValueError("PreemptionConfig.directory must name the directory to save into")
        for name in self.signals:
            if not isinstance(getattr(signal, str(name), None), signal.Signals):
                raise ValueError(
                    f"PreemptionConfig.signals has {name!r}, which is not a signal of this "
                    "system; use names such as 'SIGTERM' or 'SIGUSR1'"
                )
        if not isinstance(self.check_every, int) or self.check_every < 1:
            raise ValueError(
                f"PreemptionConfig.check_every must be a positive int, got {self.check_every!r}"
            )
        if self.exit_code is not None and not 0 <= self.exit_code <= 255:
            raise ValueError(
                f"PreemptionConfig.exit_code must be 0 to 255 or None, got {self.exit_code!r}"
            )
        if not self.grace_s > 0:
            raise ValueError(f"PreemptionConfig.grace_s must be > 0 seconds, got {self.grace_s!r}")


class Preempted(SystemExit):
    """Raised on every rank once the preemption checkpoint is saved: uncaught, it ends the
    process with ``code`` (``PreemptionConfig.exit_code``).

    Attributes:
        checkpoint: the saved checkpoint's directory.
        signal_name: the signal that came first (on any rank).
    """

    def __init__(self, code: int, checkpoint: Path, signal_name: str) -> None:
        super().__init__(code)
        self.checkpoint = checkpoint
        self.signal_name = signal_name

    def __str__(self) -> str:
        return (
            f"preempted by {self.signal_name}: saved {self.checkpoint}, exiting with status "
            f"{self.code}"
        )


class SignalWatch:
    """The signal handlers of one training run and the ranks' agreement on them."""

    def __init__(self, config: PreemptionConfig, group: dist.ProcessGroup | None) -> None:
        self.config = config
        self.group = group
        self.came: dict[int, float] = {}
        """Signal number -> ``time.monotonic()`` it first came (set by the handlers)."""
        self._previous: dict[int, Any] = {}
        self._boundaries = 0

    def install(self) -> SignalWatch:
        """Set the handlers (main thread only, as Python requires); returns self."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("save on signal must be set up from the main thread")
        for name in self.config.signals:
            number = getattr(signal, name)
            self._previous[number] = signal.signal(number, self._note)
        return self

    def uninstall(self) -> None:
        """Put the previous handlers back."""
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous.clear()

    def _note(self, signum: int, _frame: object) -> None:
        """The handler: notes when ``signum`` first came, nothing else."""
        self.came.setdefault(signum, time.monotonic())

    def agree(self) -> tuple[float, int] | None:
        """(Collective every ``check_every``-th call, at a step boundary; a no-op between.)
        ``(seconds since the first signal on any rank, a signal's number: the highest where
        ranks got different ones)`` if any rank got one, else None: the same answer on
        every rank."""
        self._boundaries += 1
        if self._boundaries % self.config.check_every:
            return None
        first = min(self.came.items(), key=lambda kv: kv[1], default=None)
        age_ms = -1 if first is None else int((time.monotonic() - first[1]) * 1000)
        values = torch.tensor([age_ms, first[0] if first else 0], dtype=torch.int64)
        if world_size_of(self.group) > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=control_group(self.group))
        if values[0] < 0:
            return None
        return values[0].item() / 1000, int(values[1].item())

    def preempt(self, age_s: float, signum: int, save: Callable[[], Path]) -> Preempted:
        """Run ``save`` (every rank, the same step), log how much of the grace it took and
        return the ``Preempted`` to raise."""
        name = signal.Signals(signum).name
        grace = self.config.grace_s
        if age_s > grace:
            logger.warning(
                "%s came %.1f s ago, more than the grace period (%.0f s): the preemption save "
                "may be killed (the previous checkpoint, %s, stays latest)",
                name,
                age_s,
                grace,
                _latest(Path(self.config.directory)),
            )
        t0 = time.monotonic()
        path = save()
        logger.warning(
            "preempted by %s: saved %s %.1f s after the signal (grace period %.0f s)",
            name,
            path,
            age_s + time.monotonic() - t0,
            grace,
        )
        self.uninstall()
        code = self.config.exit_code if self.config.exit_code is not None else 128 + signum
        return Preempted(code, path, name)


def _latest(root: Path) -> str:
    """The tag ``root/latest`` names, or "none"."""
    try:
        return read_latest(root)
    except (OSError, ValueError):
        return "none"


def save_on_signal(
    optimizer: ZeroOptimizer,
    config: PreemptionConfig,
    *,
    scheduler: Any = None,
    model: torch.nn.Module | None = None,
    extra: Callable[[], Any] | None = None,
) -> SignalWatch:
    """The PyTorch door's save on a signal: install the handlers and check at the start of
    every ``optimizer.step()`` (collective; a step pre-hook). Once any rank got a signal,
    every rank saves the state after the previous step (the scheduler as the loop left it,
    ``extra()`` as client state) into ``config.directory`` under the default tag, and
    ``optimizer.step()`` raises ``Preempted`` instead of stepping. Call on every rank, from
    the main thread; ``SignalWatch.uninstall`` undoes the handlers."""
    watch = SignalWatch(config, optimizer.flat.process_group).install()

    def check(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        agreed = watch.agree()
        if agreed is None:
            return

        def save() -> Path:
            path = save_checkpoint(
                config.directory,
                optimizer,
                scheduler=scheduler,
                model=model,
                extra=None if extra is None else extra(),
            )
            wait_for_save(optimizer)
            return path

        raise watch.preempt(*agreed, save)

    optimizer.register_step_pre_hook(check)
    return watch
