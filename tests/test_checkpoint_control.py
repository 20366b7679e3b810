"""Checkpoint coordination on the control group, and device tensors written through two
host chunks.

On NCCL a save's agreements must not run on the process group: they would queue behind
GPU work and, while one rank writes for minutes, trip the NCCL watchdog. Gloo runs here,
so ``_separate_control_needed`` is patched to give the gloo process group a gloo control
group of its own, exactly as an NCCL group gets one; the tests then check which group
every collective of a save and a load ran on, and that a stage-0 save survives a rank-0
write longer than the process group's timeout. The chunk plan of the device-tensor writer
is pure and tested here; its run on CPU must write the same bytes as the direct path; its
streamed path runs on CPU with the device seam's streams and events stubbed, and the log of
what it asked of the device shows each chunk written only after the event recorded after
its copy was synchronized, and the side stream synchronized before the chunks are freed.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flatzero import FlattenConfig, accel
from flatzero.launch import run_ranks

_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "isend",
    "irecv",
    "gather_object",
    "scatter_object_list",
)


def _separate_control_groups() -> None:
    """In this process, give every group a gloo control group of its own, as on NCCL."""
    import flatzero.control

    flatzero.own_groups._separate_control_needed = lambda group: True


class _Recorder:
    """Records ``(collective, group)`` of every call of ``torch.distributed``'s collectives
    made while ``on``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.on = False
        for name in _COLLECTIVES:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                self.calls.append((name, kwargs.get("group")))
            return fn(*args, **kwargs)

        return wrapper


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    model[1].weight.requires_grad_(False)  # a frozen param: rank 0 writes it (model rest)
    model.register_buffer("seen", torch.arange(5.0))
    return model


def _optimizer(model: nn.Module) -> Any:
    from flatzero.optim import ZeroOptimizer

    opt = ZeroOptimizer(
        [p for p in model.parameters() if p.requires_grad],
        torch.optim.AdamW,
        stage=2,
        flatten_config=FlattenConfig(bucket_numel=200, progress=False),
        lr=1e-2,
    )
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return opt


def _collectives_of_save_and_load(rank: int, ws: int, root: str) -> dict[str, Any]:
    from flatzero.checkpoint import load_checkpoint, save_checkpoint
    from flatzero.own_groups import control_group

    _separate_control_groups()
    model = _model()
    opt = _optimizer(model)
    control = control_group(opt.flat.process_group)
    assert control is not None and control is not dist.group.WORLD
    recorder = _Recorder()

    recorder.on = True
    path = save_checkpoint(root, opt, "t1", model=model)
    recorder.on = False
    save_calls = list(recorder.calls)
    recorder.calls.clear()

    before = {k: v.clone() for k, v in opt.full_params().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    inner_load = opt.load_sharded_state

    def load_sharded_state(state: Any) -> None:  # the optimizer's own check is not ours
        recorder.on = False
        inner_load(state)

    opt.load_sharded_state = load_sharded_state
    recorder.on = True
    load_checkpoint(root, opt, "t1", model=model)
    recorder.on = False
    load_calls = list(recorder.calls)
    after = opt.full_params()
    return {
        "path": str(path),
        "save": [(name, group is control) for name, group in save_calls],
        "load": [(name, group is control) for name, group in load_calls],
        "restored": all(torch.equal(before[n], after[n]) for n in before),
    }


def test_save_and_load_agree_on_the_control_group_only(tmp_path: Path) -> None:
    out = run_ranks(_collectives_of_save_and_load, 2, str(tmp_path), timeout_s=120)
    for rank_out in out:
        assert rank_out["path"] == str(tmp_path / "t1")
        assert rank_out["restored"]
        save, load = rank_out["save"], rank_out["load"]
        # Tag, errors (collect, create, write, publish), records; the waits for writing.
        assert [n for n, _ in save].count("all_gather_object") == 2, save
        assert [n for n, _ in save].count("all_reduce") == 4, save
        # Three waits for host work, each one message each way at world size 2.
        assert [n for n, _ in save].count("isend") == 3, save
        assert [n for n, _ in save].count("irecv") == 3, save
        # Agreement on what was opened, one wait for reading, the verdicts.
        assert sorted(n for n, _ in load) == ["all_reduce"] * 3 + ["irecv", "isend"], load
        off = [c for c in save + load if not c[1]]
        assert not off, f"collectives on the process group, not the control group: {off}"


def _slow_stage0_save(rank: int, ws: int, root: str, delay_s: float) -> dict[str, Any]:
    from torch.distributed.distributed_c10d import _set_pg_timeout

    import flatzero
    from flatzero.checkpoint.atomic import set_fault_hook

    _separate_control_groups()
    model = _model()
    engine, _, _, _ = flatzero.initialize(
        model=model,
        config={
            "train_batch_size": 2 * ws,
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 0},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "flatzero": {"progress": False},
        },
    )
    # Both ranks start timing together: rank 1's wait is then measured from rank 0's start.
    dist.barrier()
    # The process group's timeout (NCCL's watchdog) is shorter than rank 0's write.
    _set_pg_timeout(timedelta(seconds=delay_s / 2))

    def slow(point: str, _rank: int) -> None:
        if point == "rank_file_written":
            time.sleep(delay_s)

    set_fault_hook(slow)
    t0 = time.perf_counter()
    try:
        ok = engine.save_checkpoint(root, tag="slow")
    finally:
        set_fault_hook(None)
        _set_pg_timeout(timedelta(seconds=60))
    waited = time.perf_counter() - t0
    published = (Path(root) / "latest").read_text().strip()

    def failing(point: str, _rank: int) -> None:
        if point == "rank_file_written":
            time.sleep(delay_s / 4)
            raise OSError("disk full (injected)")

    set_fault_hook(failing)
    try:
        engine.save_checkpoint(root, tag="failing")
        error = "no error"
    except (OSError, RuntimeError) as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        set_fault_hook(None)
    engine.destroy()
    return {"ok": ok, "waited": waited, "published": published, "error": error}


def test_stage0_save_outlasts_the_process_group_timeout(tmp_path: Path) -> None:
    delay = 2.0
    out = run_ranks(_slow_stage0_save, 2, str(tmp_path), delay, timeout_s=120)
    for rank_out in out:
        assert rank_out["ok"] and rank_out["published"] == "slow"
        assert rank_out["waited"] >= delay  # rank 1 waited for rank 0's whole write
    assert out[0]["error"] == "OSError: disk full (injected)"
    assert out[1]["error"] == (
        "RuntimeError: saving the checkpoint failed on rank 0 (see its error): "
        "rank 0: OSError: disk full (injected)"
    )
    assert (tmp_path / "slow" / "meta.json").is_file()
    assert not (tmp_path / "failing").exists()


# ------------------------------------------------------------ device tensors via host chunks
@pytest.mark.parametrize(
    ("nbytes", "chunk", "slots"),
    [(0, 4, 2), (3, 4, 2), (4, 4, 2), (9, 4, 2), (12, 4, 2), (13, 4, 2), (10, 3, 3), (7, 2, 1)],
)
def test_staging_plan_covers_the_bytes_in_order(nbytes: int, chunk: int, slots: int) -> None:
    from flatzero.storage.writer import staging_plan

    ops = staging_plan(nbytes, chunk, slots)
    copies = [op for op in ops if op.kind == "copy"]
    writes = [op for op in ops if op.kind == "write"]
    chunks = -(-nbytes // chunk)
    assert len(copies) == len(writes) == chunks
    # The writes put every byte in the file once, in order; the last chunk may be short.
    assert [(op.start, op.stop) for op in writes] == [
        (k * chunk, min(nbytes, (k + 1) * chunk)) for k in range(chunks)
    ]
    assert all(0 < op.stop - op.start <= chunk for op in ops)
    in_slot: dict[int, int | None] = dict.fromkeys(range(slots))
    written: set[int] = set()
    for i, op in enumerate(ops):
        assert op.slot == op.chunk % slots
        if op.kind == "copy":
            # A slot is refilled only after the chunk in it was written.
            previous = in_slot[op.slot]
            assert previous is None or previous in written, (i, op)
            in_slot[op.slot] = op.chunk
        else:
            # A chunk is written after its copy, from the slot it was copied into.
            assert in_slot[op.slot] == op.chunk, (i, op)
            assert copies[op.chunk] == op._replace(kind="copy")
            written.add(op.chunk)
    if slots > 1:  # chunk k + 1's copy is issued before chunk k is written: they overlap
        for k in range(chunks - 1):
            assert ops.index(copies[k + 1]) < ops.index(writes[k])


def test_staging_plan_rejects_bad_sizes() -> None:
    from flatzero.storage.writer import staging_plan

    for args in ((-1, 4), (4, 0)):
        with pytest.raises(ValueError, match="staging_plan needs"):
            staging_plan(*args)


def _write(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    from flatzero.storage.header import TensorEntry
    from flatzero.storage.writer import SafetensorsWriter

    entries = [TensorEntry(n, t.dtype, tuple(t.shape)) for n, t in tensors]
    with SafetensorsWriter(path, entries, {"k": "v"}) as writer:
        for name, tensor in tensors:
            writer.write(name, tensor)
    return writer.checksum


def test_staged_writes_are_byte_identical(tmp_path: Path, monkeypatch) -> None:
    from safetensors.torch import load_file

    from flatzero.storage import writer as stwriter

    g = torch.Generator().manual_seed(3)
    tensors = [
        ("a", torch.randn(37, generator=g)),  # 148 bytes: 6 chunks of 24, the last 4
        ("b", torch.randn(5, 3, generator=g, dtype=torch.float64).t()),  # not contiguous
        ("c", torch.arange(11, dtype=torch.int16)),  # 22 bytes: one short chunk
        ("d", torch.tensor([True, False, True])),
        ("e", torch.empty(0, 4)),
        ("f", torch.randn(6, generator=g).to(torch.bfloat16)),  # 12 bytes
    ]
    direct = _write(tmp_path / "direct.safetensors", tensors)

    copies: list[int] = []
    real_plan = stwriter.staging_plan

    def plan(nbytes: int, chunk_bytes: int, slots: int = 2) -> list[stwriter.ChunkOp]:
        ops = real_plan(nbytes, chunk_bytes, slots)
        copies.append(sum(op.kind == "copy" for op in ops))
        return ops

    monkeypatch.setattr(stwriter, "_CHUNK_BYTES", 24)
    monkeypatch.setattr(stwriter, "staging_plan", plan)
    monkeypatch.setattr(stwriter, "_staged", lambda tensor: True)  # as if on a device
    staged = _write(tmp_path / "staged.safetensors", tensors)

    assert copies == [7, 5, 1, 1, 1]  # chunks of a, b, c, d, f ("e" has no bytes)
    assert (tmp_path / "staged.safetensors").read_bytes() == (
        tmp_path / "direct.safetensors"
    ).read_bytes()
    assert staged == direct
    back = load_file(tmp_path / "staged.safetensors")
    assert all(torch.equal(back[n], t) for n, t in tensors)


class _FakeCuda:
    """Stand-ins for the device seam's stream calls of the staged writer that log, in order, what
    a real device would be asked to do (copies happen at once on the CPU)."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.streams = 0
        self.events = 0
        self.side: Any = None

    def install(self, monkeypatch) -> None:
        cuda = self

        class Stream:
            def __init__(self, device: Any = None) -> None:
                cuda.streams += 1
                self.name = f"side{cuda.streams}"
                cuda.side = self

            def wait_stream(self, other: Any) -> None:
                cuda.log.append(("wait_stream", self.name, other))

            def synchronize(self) -> None:
                cuda.log.append(("stream_synchronize", self.name))

        class Event:
            def __init__(self) -> None:
                cuda.events += 1
                self.name = cuda.events

            def record(self, stream: Any) -> None:
                cuda.log.append(("record", self.name, stream.name))

            def synchronize(self) -> None:
                cuda.log.append(("event_synchronize", self.name))

        class Context:
            def __init__(self, what: Any) -> None:
                self.what = what

            def __enter__(self) -> None:
                if isinstance(self.what, Stream):
                    cuda.log.append(("on_stream", self.what.name))

            def __exit__(self, *exc: Any) -> None:
                if isinstance(self.what, Stream):
                    cuda.log.append(("off_stream", self.what.name))

        monkeypatch.setattr(accel, "new_stream", Stream)
        monkeypatch.setattr(accel, "new_event", lambda device=None: Event())
        monkeypatch.setattr(accel, "current_stream", lambda device=None: "current")
        monkeypatch.setattr(accel, "use_stream", Context)
        monkeypatch.setattr(accel, "on_device", Context)


def _staged_on_fake_cuda(monkeypatch, fail_at_write: int | None = None):
    """Route CPU tensors through the streamed path of the staged writer with the seam's
    streams and pinning stubbed; returns the fake (its log: copies, writes, pins, unpins)
    and the ``non_blocking`` flag of every copy."""
    from flatzero.storage import writer as stwriter

    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    copies: list[bool] = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(stwriter, "_CHUNK_BYTES", 16)
    monkeypatch.setattr(stwriter, "_staged", lambda tensor: True)
    monkeypatch.setattr(stwriter, "_streamed", lambda tensor: True)
    monkeypatch.setattr(accel, "pin_host", lambda t: cuda.log.append(("pin", t.data_ptr())) or True)
    monkeypatch.setattr(accel, "unpin_host", lambda t: cuda.log.append(("unpin", t.data_ptr())))
    release = lambda: cuda.log.append(("release",))  # noqa: E731
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", release)
    real_emit = stwriter.SafetensorsWriter._emit
    writes = 0

    def emit(self, host: torch.Tensor, crc: int) -> int:
        nonlocal writes
        writes += 1
        if fail_at_write == writes:
            raise OSError("disk full (injected)")
        cuda.log.append(("write", bytes(host.numpy())))
        return real_emit(self, host, crc)

    def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        copies.append(non_blocking)
        cuda.log.append(("copy", bytes(src.numpy())))
        return real_copy(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(stwriter.SafetensorsWriter, "_emit", emit)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    return cuda, copies


def test_cuda_chunks_are_written_only_after_their_copy_event(tmp_path: Path, monkeypatch) -> None:
    from safetensors.torch import load_file

    tensors = [("a", torch.arange(13, dtype=torch.float32)), ("b", torch.arange(3.0))]
    direct = _write(tmp_path / "direct.safetensors", tensors)
    cuda, non_blocking = _staged_on_fake_cuda(monkeypatch)
    staged = _write(tmp_path / "staged.safetensors", tensors)
    monkeypatch.undo()

    assert staged == direct
    assert (tmp_path / "staged.safetensors").read_bytes() == (
        tmp_path / "direct.safetensors"
    ).read_bytes()
    assert all(torch.equal(load_file(tmp_path / "staged.safetensors")[n], t) for n, t in tensors)
    assert non_blocking and all(non_blocking)  # pinned chunks: asynchronous copies
    log = cuda.log
    # The chunks flatzero pinned are unpinned at the end, and nothing else of the process.
    pinned = sorted(e[1] for e in log if e[0] == "pin")
    assert len(pinned) == 2 and sorted(e[1] for e in log[-2:] if e[0] == "unpin") == pinned
    assert ("release",) not in log
    # Per tensor: the side stream first waits for the current stream (the tensor's writer).
    starts = [i for i, e in enumerate(log) if e[0] == "wait_stream"]
    assert [log[i] for i in starts] == [
        ("wait_stream", "side1", "current"),
        ("wait_stream", "side2", "current"),
    ]
    copy_events: dict[int, bytes] = {}  # event -> the chunk whose copy it was recorded after
    pending: bytes | None = None
    synced: set[int] = set()
    for i, entry in enumerate(log):
        if entry[0] == "copy":
            assert log[i - 1][0] == "on_stream" and log[i + 1][0] == "off_stream"  # on the side
            assert any(s < i for s in starts)
            pending = entry[1]
        elif entry[0] == "record":
            assert pending is not None
            copy_events[entry[1]] = pending
            synced.discard(entry[1])
            pending = None
        elif entry[0] == "event_synchronize":
            synced.add(entry[1])
        elif entry[0] == "write":
            # The chunk written was copied, and the event recorded after its copy completed.
            assert any(copy_events[e] == entry[1] for e in synced), (i, entry)
            done = next(e for e in synced if copy_events[e] == entry[1])
            synced.discard(done)
    # a: 52 bytes, chunks of 16: the copy of chunk k + 1 is issued before chunk k is written.
    kinds = [e[0] for e in log if e[0] in ("copy", "write")]
    assert kinds[:5] == ["copy", "copy", "write", "copy", "write"]
    assert [e[0] for e in log].count("stream_synchronize") == 2  # each tensor, at its end


def test_cuda_path_waits_for_its_copies_when_a_write_fails(tmp_path: Path, monkeypatch) -> None:
    cuda, _ = _staged_on_fake_cuda(monkeypatch, fail_at_write=2)
    with pytest.raises(OSError, match="disk full"):
        _write(tmp_path / "x.safetensors", [("a", torch.arange(13, dtype=torch.float32))])
    monkeypatch.undo()
    kinds = [e[0] for e in cuda.log]
    # The copy of chunk 2 was in flight: the side stream is synchronized before the chunks
    # are unpinned and dropped.
    assert kinds[-3:] == ["stream_synchronize", "unpin", "unpin"]
    assert kinds.count("copy") == 3 and kinds.count("write") == 1
