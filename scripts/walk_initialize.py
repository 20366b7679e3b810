"""Walk one ``flatzero.initialize`` (one rank, gloo, CPU, a two-layer MLP, ZeRO-2) and list
the rooms its calls pass through, in order, with the floor of each (``scripts/house.py``).

Usage: python scripts/walk_initialize.py

A call from a room into another room is a step; a step to a higher floor is a climb (with
no import climbing, only a function handed down can do it: a tier factory, a hook); the
report counts the rooms visited, the climbs (and who made them) and how often each room
is entered. Prints Markdown for docs/architecture.md.
"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import house

PREFIX = house.PACKAGE + "."


def _room(frame) -> str | None:
    name = frame.f_globals.get("__name__", "")
    if name == house.PACKAGE or name.startswith(PREFIX):
        return house.room_of(name)
    return None


def walk() -> tuple[list[tuple[str, str, str]], collections.Counter[str]]:
    """The steps between rooms of one ``initialize`` (caller room, callee room, the callee's
    function), and how often each room was entered."""
    import torch
    from torch import nn

    import flatzero

    os.environ.setdefault("MASTER_PORT", "29517")
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "flatzero": {"progress": False},
    }
    steps: list[tuple[str, str, str]] = []
    entered: collections.Counter[str] = collections.Counter()

    def profile(frame, event, _arg):
        if event != "call":
            return
        callee = _room(frame)
        if callee is None:
            return
        caller_frame = frame.f_back
        while caller_frame is not None and _room(caller_frame) is None:
            caller_frame = caller_frame.f_back  # through torch or the standard library
        caller = _room(caller_frame) if caller_frame is not None else "user"
        if caller != callee:
            where = f"{frame.f_globals['__name__']}.{frame.f_code.co_qualname}"
            steps.append((caller, callee, where))
            entered[callee] += 1

    sys.setprofile(profile)
    try:
        engine, *_ = flatzero.initialize(model=model, config=config)
    finally:
        sys.setprofile(None)
    engine.optimizer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return steps, entered


def main() -> int:
    steps, entered = walk()
    order = list(dict.fromkeys(callee for _caller, callee, _where in steps))
    climbs = collections.Counter(
        (a, b, where)
        for a, b, where in steps
        if a != "user" and house.floor_of(b) > house.floor_of(a)
    )
    print(f"rooms visited, in order of first entry ({len(order)}):")
    print(" -> ".join(f"{r} ({house.floor_of(r)})" for r in order))
    print(f"\nsteps between rooms: {len(steps)}; climbs: {sum(climbs.values())}")
    for (a, b, where), n in climbs.most_common():
        print(f"- {a} ({house.floor_of(a)}) -> {b} ({house.floor_of(b)}), `{where}`: {n}")
    print("\nentries per room:")
    for room, n in entered.most_common():
        print(f"- {room}: {n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
