"""Asynchronous saves (issue 24 item 4): the checkpoint holds the state at the call, the
snapshot buffer is reused, a background error is raised at the next call on every rank,
and a kill during the background write leaves the previous checkpoint loadable."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import torch

from flatzero import FlattenConfig
from flatzero.checkpoint import load_checkpoint, load_flat_params, read_latest, save_checkpoint
from flatzero.checkpoint.atomic import set_fault_hook
from flatzero.checkpoint.checkpointer import checkpointer_of, release_snapshot, wait_for_save
from flatzero.launch import run_ranks
from flatzero.optim import ZeroOptimizer


def make() -> tuple[torch.nn.Module, ZeroOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    opt = ZeroOptimizer(
        model.named_parameters(),
        torch.optim.AdamW,
        lr=1e-2,
        flatten_config=FlattenConfig(bucket_numel=256, progress=False),
    )
    return model, opt


def step(model: torch.nn.Module, opt: ZeroOptimizer, i: int) -> None:
    g = torch.Generator().manual_seed(100 * i + opt.rank)
    model(torch.randn(4, 16, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def state(opt: ZeroOptimizer) -> dict[str, torch.Tensor]:
    """This rank's master and moment shards (copies)."""
    sd = opt.sharded_state()
    out = {}
    for gi, g in enumerate(sd.groups):
        out[f"{gi}.master"] = g.master.clone()
        out |= {f"{gi}.{k}": v.clone() for k, v in g.shards.items()}
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def slow_writes(point: str, _rank: int) -> None:
    if point == "tensor_written":
        time.sleep(0.05)  # the background write outlasts the training steps below


def async_saves(rank: int, ws: int, base: str) -> dict:
    root = Path(base)
    model, opt = make()
    step(model, opt, 0)
    set_fault_hook(slow_writes)
    at_a = state(opt)
    save_checkpoint(root, opt, tag="a", asynchronous=True)
    writing = [t.name for t in threading.enumerate() if t.name.startswith("flatzero-save")]
    returned_before_published = not (root / "a").exists()
    buffer = checkpointer_of(opt).snapshot.data.data_ptr()
    for i in (1, 2):  # train on while "a" is written: it must keep the state at the call
        step(model, opt, i)
    at_b = state(opt)
    save_checkpoint(root, opt, tag="b", asynchronous=True)  # waits for "a" first
    a_published_then = (root / "a" / "meta.json").is_file()
    reused = checkpointer_of(opt).snapshot.data.data_ptr() == buffer
    step(model, opt, 3)
    wait_for_save(opt)
    set_fault_hook(None)
    loaded = {}
    for tag in ("a", "b"):
        _, fresh = make()
        load_checkpoint(root, fresh, tag)
        loaded[tag] = same(state(fresh), at_a if tag == "a" else at_b)
        fresh.close()

    # an error in rank 1's background write is raised at the next call, on every rank
    def fail(point: str, r: int) -> None:
        if point == "rank_file_written" and r == 1:
            raise OSError("disk full (injected)")

    set_fault_hook(fail)
    save_checkpoint(root, opt, tag="c", asynchronous=True)
    try:
        save_checkpoint(root, opt, tag="d")  # raises before it writes anything
        error = "no error"
    except (OSError, RuntimeError) as e:
        error = f"{type(e).__name__}: {e}"
    set_fault_hook(None)
    return {
        "writing": writing,
        "returned_before_published": returned_before_published,
        "a_published_then": a_published_then,
        "reused": reused,
        "loaded": loaded,
        "error": error,
        "latest": read_latest(root),
        "entries": sorted(p.name for p in root.iterdir()),
    }


def test_async_saves_at_two_ranks(tmp_path):
    out = run_ranks(async_saves, 2, str(tmp_path), timeout_s=120)
    for rank, o in enumerate(out):
        assert o["writing"] == ["flatzero-save-a"] and o["returned_before_published"]
        assert o["a_published_then"] and o["reused"]
        assert o["loaded"] == {"a": True, "b": True}
        # every rank's error names rank 1 and its error (issue 40 item 2)
        if rank == 1:
            assert o["error"] == "OSError: rank 1: disk full (injected)"
        else:
            # rank 0's thread read rank 1's error from its report in the store
            assert o["error"].startswith("RuntimeError: rank 1 failed to write its file")
            assert o["error"].endswith("OSError: rank 1: disk full (injected)")
        # c was never published and its directory is gone; d was not started
        assert o["latest"] == "b" and o["entries"] == ["a", "b", "latest"]


def killed_in_the_background(root: str) -> None:
    """(Forked child.) Start an asynchronous save of ``b`` and die in its thread."""
    torch.set_num_threads(1)
    model, opt = make()
    load_checkpoint(root, opt)
    step(model, opt, 1)

    def die(point: str, _rank: int) -> None:
        if point == "tensor_written" and threading.current_thread().name != "MainThread":
            os.kill(os.getpid(), signal.SIGKILL)

    set_fault_hook(die)
    save_checkpoint(root, opt, tag="b", asynchronous=True)
    time.sleep(30)  # killed before this ends
    os._exit(0)


def test_a_kill_during_the_background_write_leaves_the_previous_checkpoint(tmp_path):
    model, opt = make()
    step(model, opt, 0)
    saved = state(opt)
    save_checkpoint(tmp_path, opt, tag="a")
    child = multiprocessing.get_context("fork").Process(
        target=killed_in_the_background, args=(str(tmp_path),)
    )
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert read_latest(tmp_path) == "a" and not (tmp_path / "b").exists()
    _, fresh = make()
    assert load_checkpoint(tmp_path, fresh).tag == "a"
    assert same(state(fresh), saved)


def held_until_copied(rank: int, ws: int, base: str) -> dict:
    """An asynchronous save returns before its background thread copies the master and
    moment shards; the forward and backward passes after it run meanwhile. The next step's
    inner update first copies what the held thread has not (it does not wait for it), so
    the checkpoint holds the state at the call. Then the same with the thread failing
    before it copies (rank 1): the step still returns, the error reaches every rank at the
    next call. And ``load_flat_params`` right after a save waits for the copies too."""
    root = Path(base)
    model, opt = make()
    step(model, opt, 0)
    at_save = state(opt)
    copying, release = threading.Event(), threading.Event()

    def held_copy(point: str, _rank: int) -> None:
        if point == "copying_snapshot":
            copying.set()
            release.wait(30)

    set_fault_hook(held_copy)
    save_checkpoint(root, opt, tag="a", asynchronous=True)
    copy_started = copying.wait(30)
    step(model, opt, 1)  # backward, then the step copies the snapshot itself
    step_returned_while_held = not release.is_set()
    release.set()
    wait_for_save(opt)
    set_fault_hook(None)
    _, fresh = make()
    load_checkpoint(root, fresh, "a")
    saved_the_state_at_the_call = same(state(fresh), at_save)
    step_changed_the_state = not same(state(opt), at_save)

    def fail_copy(point: str, r: int) -> None:
        if point == "copying_snapshot" and r == 1:
            raise OSError("no thread left (injected)")

    at_b = state(opt)
    set_fault_hook(fail_copy)
    save_checkpoint(root, opt, tag="b", asynchronous=True)
    step(model, opt, 2)  # no hang on rank 1: its fence copies
    set_fault_hook(None)
    try:
        wait_for_save(opt)
        error = "no error"
    except (OSError, RuntimeError) as e:
        error = f"{type(e).__name__}: {e}"

    at_c = state(opt)
    save_checkpoint(root, opt, tag="c", asynchronous=True)
    try:
        release_snapshot(opt)
        release_refused = False
    except RuntimeError:
        release_refused = True
    load_flat_params(opt.flat, root, "a")  # waits for the copies of "c" first
    wait_for_save(opt)
    _, fresh_c = make()
    load_checkpoint(root, fresh_c, "c")
    return {
        "copy_started": copy_started,
        "step_returned_while_held": step_returned_while_held,
        "saved_the_state_at_the_call": saved_the_state_at_the_call,
        "step_changed_the_state": step_changed_the_state,
        "b_changed_by_the_step": not same(at_b, at_c),
        "error": error,
        "release_refused": release_refused,
        "c_is_the_state_at_its_call": same(state(fresh_c), at_c),
    }


def test_the_next_step_finishes_the_snapshot_copy(tmp_path):
    out = run_ranks(held_until_copied, 2, str(tmp_path), timeout_s=120)
    for rank, o in enumerate(out):
        error = o.pop("error")
        assert o == {
            "copy_started": True,
            "step_returned_while_held": True,
            "saved_the_state_at_the_call": True,
            "step_changed_the_state": True,
            "b_changed_by_the_step": True,
            "release_refused": True,
            "c_is_the_state_at_its_call": True,
        }
        if rank == 1:
            assert error == "OSError: rank 1: no thread left (injected)"
        else:
            assert error.startswith("RuntimeError:") and "rank 1" in error
