"""Replacing a tag (issue 24 item 1): a crash between the two steps of a replace leaves the
tag loadable, and the next save neither loses nor deletes the only good copy.

Each case saves tag ``t`` at step 1 in this process, then a forked child (no process
group) trains one more step and saves ``t`` again with ``overwrite=True``, killing itself
(SIGKILL) at the fault point between the two steps: ``after_exchange`` on this machine's
file system (``renameat2(RENAME_EXCHANGE)``), ``between_renames`` with the exchange
disabled (the fallback: old directory aside, new one not yet in).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from pathlib import Path

import pytest
import torch

from flatzero import FlattenConfig
from flatzero.checkpoint import SaveConfig, atomic, load_checkpoint, read_latest, save_checkpoint
from flatzero.checkpoint.atomic import REPLACED, set_fault_hook
from flatzero.optim import ZeroOptimizer


def make() -> tuple[torch.nn.Module, ZeroOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = ZeroOptimizer(
        model.named_parameters(),
        torch.optim.AdamW,
        lr=1e-2,
        flatten_config=FlattenConfig(bucket_numel=100, progress=False),
    )
    return model, opt


def step(model: torch.nn.Module, opt: ZeroOptimizer, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(5, 8, generator=g)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def replace_and_die(root: str, point: str, exchange: bool, out: str) -> None:
    """(Forked child.) Train to step 2, save ``t`` over the step-1 one, die at ``point``."""
    torch.set_num_threads(1)
    model, opt = make()
    load_checkpoint(root, opt)
    step(model, opt, 1)
    torch.save(opt.full_params(), out)  # what the replacing save holds
    if not exchange:
        atomic._renameat2 = lambda: None  # the fallback: two renames

    def die(where: str, _rank: int) -> None:
        if where == point:
            os.kill(os.getpid(), signal.SIGKILL)

    set_fault_hook(die)
    save_checkpoint(root, opt, tag="t", config=SaveConfig(overwrite=True))
    atomic.wait_for_removals()  # a point in the deletion's thread is reached before exit
    os._exit(0)  # not reached


def crash_while_replacing(tmp_path: Path, point: str, exchange: bool) -> tuple[Path, dict]:
    root = tmp_path / "run"
    model, opt = make()
    step(model, opt, 0)
    save_checkpoint(root, opt, tag="t")
    out = tmp_path / "new.pt"
    child = multiprocessing.get_context("fork").Process(
        target=replace_and_die, args=(str(root), point, exchange, str(out))
    )
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    return root, torch.load(out)


def loaded(root: Path, tag: str | None = None) -> tuple[int | None, dict]:
    _, opt = make()
    result = load_checkpoint(root, opt, tag)
    return result.step, opt.full_params()


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_exchange_keeps_the_tag_complete_at_every_instant(tmp_path):
    assert atomic._renameat2() is not None, "this test needs Linux's renameat2"
    root, new = crash_while_replacing(tmp_path, "after_exchange", exchange=True)
    # killed after the exchange: the new checkpoint is in, the old one under a .tmp- name
    assert (root / "t" / "meta.json").is_file() and read_latest(root) == "t"
    (old,) = [p for p in root.iterdir() if p.name.startswith(".tmp-t-")]
    assert REPLACED not in old.name
    saved_step, params = loaded(root)
    assert saved_step == 2
    assert_same(params, new)
    _, opt = make()
    save_checkpoint(root, opt, tag="u", config=SaveConfig(stale_tmp_age_s=0))
    assert sorted(p.name for p in root.iterdir()) == ["latest", "t", "u"]


@pytest.mark.parametrize("exchange", [True, False])
def test_killed_while_deleting_the_replaced_copy(tmp_path, exchange):
    """Killed in the thread that deletes the old copy (before it deleted anything): the
    tag is the new checkpoint, the old one sits, complete, under a ``.tmp-.removing-``
    name that neither loading nor recovery takes for a copy of ``t``, and the next save
    removes it though it is younger than ``stale_tmp_age_s``."""
    if exchange:
        assert atomic._renameat2() is not None, "this test needs Linux's renameat2"
    root, new = crash_while_replacing(tmp_path, "removing", exchange=exchange)
    assert (root / "t" / "meta.json").is_file() and read_latest(root) == "t"
    (doomed,) = [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert doomed.name.startswith(atomic.REMOVING) and (doomed / "meta.json").is_file()
    saved_step, params = loaded(root)
    assert saved_step == 2
    assert_same(params, new)
    _, opt = make()
    save_checkpoint(root, opt, tag="u")  # the default stale_tmp_age_s: an hour
    assert sorted(p.name for p in root.iterdir()) == ["latest", "t", "u"]
    assert loaded(root, "t")[0] == 2


def test_killed_between_renames_loads_the_complete_copy(tmp_path, caplog):
    root, new = crash_while_replacing(tmp_path, "between_renames", exchange=False)
    # the window of the fallback: no t, the old one aside, the new one complete
    assert not (root / "t").exists() and read_latest(root) == "t"
    names = sorted(p.name for p in root.iterdir())
    assert len(names) == 3 and any(REPLACED in n for n in names), names
    with caplog.at_level(logging.WARNING, logger="flatzero.checkpoint.reader"):
        saved_step, params = loaded(root)
    assert saved_step == 2  # the newest complete copy: the replacing save's
    assert_same(params, new)
    assert "killed while replacing" in caplog.text
    saved_step, _ = loaded(root, "t")  # the same by name
    assert saved_step == 2

    # a later save puts t back and removes the other copy, never the good one
    _, opt = make()
    with caplog.at_level(logging.WARNING, logger="flatzero.checkpoint.recovery"):
        save_checkpoint(root, opt, tag="u", config=SaveConfig(stale_tmp_age_s=0))
    assert "restored it" in caplog.text
    assert sorted(p.name for p in root.iterdir()) == ["latest", "t", "u"]
    saved_step, params = loaded(root, "t")
    assert saved_step == 2
    assert_same(params, new)


def test_cleanup_keeps_the_only_copy_it_cannot_restore(tmp_path):
    """A lost tag whose directory reappeared without meta.json (damaged by hand) is not
    overwritten by the restore; its complete copies survive every cleanup."""
    root, new = crash_while_replacing(tmp_path, "between_renames", exchange=False)
    (root / "t").mkdir()
    _, opt = make()
    for tag in ("u", "v"):
        save_checkpoint(root, opt, tag=tag, config=SaveConfig(stale_tmp_age_s=0))
    kept = [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert len(kept) == 2 and any(REPLACED in p.name for p in kept)
    (root / "t").rmdir()
    saved_step, params = loaded(root, "t")
    assert saved_step == 2
    assert_same(params, new)


def test_a_save_killed_before_publishing_a_new_tag_is_not_restored(tmp_path):
    """A new tag whose save died before its rename was never published: it is not lost,
    it is an unfinished save, removed by the next one."""
    root = tmp_path / "run"
    model, opt = make()
    step(model, opt, 0)
    save_checkpoint(root, opt, tag="a")

    def child() -> None:
        set_fault_hook(
            lambda p, _r: os.kill(os.getpid(), signal.SIGKILL) if p == "before_publish" else None
        )
        save_checkpoint(root, opt, tag="b")

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    with pytest.raises(ValueError, match="does not exist or is incomplete"):
        loaded(root, "b")
    save_checkpoint(root, opt, tag="c", config=SaveConfig(stale_tmp_age_s=0))
    assert sorted(p.name for p in root.iterdir()) == ["a", "c", "latest"]
