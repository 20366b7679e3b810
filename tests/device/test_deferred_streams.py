"""The device suite's stream-ordering tests, on the emulated device in the deferred mode.

In the deferred mode ([Note: deferred streams] in ``flatzero.testing.emulated.streams``) a
``non_blocking`` copy on a side stream runs only once something orders it (its stream
synchronized or waited on, an event after it synchronized or waited on, a device
synchronize), so a missing wait shows as stale values. Here the parity tests of
ZeRO-1/2 (stage 2's reductions), optimizer offload, the asynchronous save and the
``sharded`` upload tier run again in that mode (``FLATZERO_EMU_STREAMS=deferred`` in the
rank processes' environment, which also gives the emulated device host registration, so
the copies are asynchronous as on CUDA); then the mode itself, and a planted missing wait
it catches where the synchronous mode does not.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import test_optimizer_parity as parity
from flatzero import accel
from flatzero.testing.emulated.registration import DEFERRED_ENV

from . import test_device_flatten, test_device_optimizer
from .harness import launch, this_device
from .test_device_offload import offload_problems


@pytest.fixture
def deferred(monkeypatch):
    """Rank processes launched in the test install the emulated device deferred."""
    monkeypatch.setenv(DEFERRED_ENV, "deferred")
    monkeypatch.setattr(parity, "STEPS", test_device_optimizer.STEPS)


@pytest.mark.parametrize("world_size", [1, 2])
def test_parity_offload_and_async_save_hold_with_deferred_streams(deferred, world_size):
    """ZeRO-1/2 against AdamW (stage 2 at 2 ranks), with the asynchronous save at 1 rank
    and optimizer offload at 2 (``test_device_optimizer``'s launches, deferred)."""
    test_device_optimizer.test_zero_1_and_2_on_the_device_match_adamw("emu", world_size)


@pytest.mark.parametrize("world_size", [1, 3])
def test_upload_tiers_hold_with_deferred_streams(deferred, world_size):
    """The ``host`` and ``sharded`` tiers' uploads (a copy stream, a pinned ring)."""
    test_device_flatten.test_upload_tiers_fill_device_buckets_bitwise("emu", world_size)


def _mode_worker(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    device = this_device(kind)
    src = torch.arange(4.0, device=device)
    host = torch.zeros(4)
    side = accel.new_stream(device)
    seen: dict[str, Any] = {}
    with accel.use_stream(side):
        host.copy_(src, non_blocking=True)
        event = accel.new_event(device)
        event.record(side)
    seen["before the wait"] = host.tolist()
    src.add_(10)  # the default stream changes the source before the copy was ordered
    event.synchronize()
    seen["after the event"] = host.tolist()
    with accel.use_stream(side):
        host.copy_(src, non_blocking=True)
    seen["pending"] = host.tolist()
    accel.current_stream(device).wait_stream(side)
    seen["after wait_stream"] = host.tolist()
    with accel.use_stream(side):
        host.zero_()
        host.copy_(src, non_blocking=False)
    seen["blocking"] = host.tolist()
    with accel.use_stream(side):
        src.copy_(torch.ones(4), non_blocking=True)
    accel.synchronize(device)
    seen["after synchronize"] = src.tolist()
    return seen


def test_the_deferred_mode_holds_copies_until_they_are_waited_for(deferred):
    (seen,) = launch("emu", _mode_worker, 1)
    assert seen == {
        "before the wait": [0.0, 0.0, 0.0, 0.0],
        "after the event": [10.0, 11.0, 12.0, 13.0],  # the copy read its source late
        "pending": [10.0, 11.0, 12.0, 13.0],
        "after wait_stream": [10.0, 11.0, 12.0, 13.0],
        "blocking": [10.0, 11.0, 12.0, 13.0],
        "after synchronize": [1.0, 1.0, 1.0, 1.0],
    }


def _planted_worker(rank: int, world_size: int, kind: str) -> list[str]:
    """``offload_problems`` with the offload's wait for the clip coefficient's copy taken
    out (``HostOffload.to_host`` reads the host scalar without its event)."""
    from flatzero.optim import offload

    def to_host_without_the_wait(self, value: torch.Tensor) -> torch.Tensor:
        with self._side_stream():
            self._scalar.copy_(value, non_blocking=self.pinned)
        return self._scalar

    offload.HostOffload.to_host = to_host_without_the_wait
    # one rank: stage 2 starts no copy during backward (nothing is reduced then)
    return [p for p in offload_problems(rank, world_size, kind) if "during backward" not in p]


def test_a_planted_missing_wait_is_caught_only_in_the_deferred_mode(monkeypatch):
    (synchronous,) = launch("emu", _planted_worker, 1)
    assert synchronous == []  # the synchronous emulator cannot see it
    monkeypatch.setenv(DEFERRED_ENV, "deferred")
    (problems,) = launch("emu", _planted_worker, 1)
    assert any("master" in p for p in problems), problems
