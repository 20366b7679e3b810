"""Loading a tag while another process replaces it (issue 40 item 7), for real.

A writer process saves tag ``t`` over and over (``overwrite=True``), each save's fp32
masters and a buffer (in ``model_rest.safetensors``) all equal to its number, and
``extra={"k": number}``; this process loads ``t`` in a loop meanwhile, for a few seconds.
Every load must either succeed with masters and buffer equal to the loaded ``extra`` (never
one save's ``meta.json`` with another's files, also with ``verify=False``) or say the tag
is being replaced; never that it is corrupt or deleted.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from flatzero import FlattenConfig
from flatzero.checkpoint import LoadConfig, SaveConfig, load_checkpoint, save_checkpoint
from flatzero.checkpoint.format import CheckpointReplaced
from flatzero.optim import ZeroOptimizer

_SECONDS = 2.5
"""How long the reader loads while the writer replaces."""


def _optimizer() -> tuple[torch.nn.Module, ZeroOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    model.register_buffer("k", torch.zeros(16))  # in model_rest.safetensors
    return model, ZeroOptimizer(
        model.named_parameters(),
        torch.optim.SGD,
        lr=0.1,
        flatten_config=FlattenConfig(bucket_numel=1000, progress=False),
    )


def _replace_forever(root: str, keep_last: int | None, started: object) -> None:
    """(Writer process.) Save ``t`` again and again, each save's masters equal to its number."""
    torch.set_num_threads(1)
    model, opt = _optimizer()
    config = SaveConfig(overwrite=True, keep_last=keep_last)
    k = 0
    while True:
        k += 1
        with torch.no_grad():
            for master in opt._masters:
                master.fill_(float(k))
            model.k.fill_(float(k))
        save_checkpoint(root, opt, "t", model=model, extra={"k": k}, config=config)
        started.set()  # type: ignore[attr-defined]


@pytest.mark.parametrize(("keep_last", "verify"), [(None, True), (1, True), (None, False)])
def test_loading_a_tag_being_replaced_is_never_corrupt_nor_mixed(
    tmp_path: Path, keep_last, verify, caplog
):
    caplog.set_level(logging.INFO, logger="flatzero.checkpoint.fallback")
    torch.set_num_threads(1)
    root = tmp_path / "ckpt"
    ctx = multiprocessing.get_context("fork")
    started = ctx.Event()
    writer = ctx.Process(target=_replace_forever, args=(str(root), keep_last, started))
    writer.start()
    try:
        assert started.wait(60)
        model, opt = _optimizer()
        loads, replaced, wrong, seen = 0, 0, [], set()
        end = time.monotonic() + _SECONDS
        while time.monotonic() < end:
            try:
                config = LoadConfig(verify=verify)
                result = load_checkpoint(root, opt, "t", model=model, config=config)
            except CheckpointReplaced as error:
                assert "being replaced" in str(error), error
                replaced += 1
                continue
            loads += 1
            k = result.extra["k"]
            seen.add(k)
            values = torch.cat([m.flatten() for m in opt._masters]).unique().tolist()
            values.extend([-v for v in model.k.unique().tolist()])
            if {abs(v) for v in values} - {0.0} != {float(k)}:  # 0: the buckets' padding
                wrong.append((k, values[:4]))
    finally:
        writer.kill()
        writer.join(10)
    assert not wrong, f"{len(wrong)} of {loads} loads mixed two saves: {wrong[:3]}"
    assert loads > 10, (loads, replaced)
    again = sum("loading it again" in r.getMessage() for r in caplog.records)
    print(
        f"keep_last={keep_last} verify={verify}: {loads} loads of {len(seen)} saves, "
        f"{again} loaded again, {replaced} said being replaced"
    )
