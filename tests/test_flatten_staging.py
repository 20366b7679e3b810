"""The flatten's staging and memory: the allocator's cache after init, pinned
staging that releases only flatzero's pages, a fill error on one rank agreed before the
sharded all-gather, and the upload of bucket k + 1 overlapping the all-gather of bucket k.

The device half runs on the emulated accelerator (``flatzero.testing.emulated``, exact
counters) in one run of 2 spawned ranks (the module fixture ``emu_run``), whose worker
does every feature's device part in turn. Stream order cannot be observed there (it is
synchronous), so the upload pipeline and the pinned path run the streamed upload on CPU
buffers with
the device seam's stream, event and pinning functions replaced by a recording fake
(``_Recorder``), and the assertions are on the order of what a device would have been
asked to do; its multi-rank part shares one run of 3 gloo ranks with the fill errors (``gloo_run``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from device.harness import UnevenNet, host_copy, launch, this_device, unchanged
from flatzero import FlattenConfig, accel, flatten_parameters
from flatzero.flatten import BucketFillError, driver, tiers
from flatzero.flatten.source import CheckpointSource, TensorSource
from flatzero.hostmem import mapped_host
from flatzero.launch import run_ranks
from flatzero.memory import DeviceOutOfMemoryError
from flatzero.storage import writer as stwriter
from flatzero.storage.header import TensorEntry
from flatzero.testing import emulated

BUCKET = 1024  # elements: UnevenNet makes 6 buckets of fp32 at 2 or 3 ranks


def _config(**kw: Any) -> FlattenConfig:
    return FlattenConfig(bucket_numel=BUCKET, progress=False, **kw)


def _bucket_bytes(flat) -> list[bytes]:
    return [bytes(b.cpu().view(torch.uint8).numpy()) for g in flat.groups for b in g.buckets]


# ------------------------------------------------------------ a recording device seam
def never_empty_the_pinned_cache() -> None:
    raise AssertionError("the process-wide pinned cache must never be emptied")


class _Stream:
    def __init__(self, log: list[tuple], name: str) -> None:
        self.log, self.name = log, name

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: _Event) -> None:
        self.log.append(("wait_event", self.name, event.id))

    def synchronize(self) -> None:
        self.log.append(("stream_sync", self.name))


class _Event:
    count = 0

    def __init__(self, log: list[tuple]) -> None:
        _Event.count += 1
        self.log, self.id = log, _Event.count

    def record(self, stream: _Stream) -> None:
        self.log.append(("record", self.id, stream.name))

    def synchronize(self) -> None:
        self.log.append(("event_sync", self.id))

    def query(self) -> bool:
        return True  # CPU copies are done when they return


class _Recorder:
    """Stand-ins for the device seam's streams, events and pinning that log, in order, what
    a device would be asked to do; copies, host reads, all-gathers and bucket allocations
    of the flatten are logged beside them (by data pointer)."""

    def __init__(self, register: bool = True) -> None:
        self.log: list[tuple] = []
        self.register = register
        self.current = _Stream(self.log, "current")
        self._on_copy_stream = False

    def install(self, set_attr: Callable[[Any, str, Any], None]) -> None:
        """Install with ``set_attr`` (``monkeypatch.setattr``, or ``setattr`` in a rank)."""
        log = self.log

        @contextlib.contextmanager
        def use_stream(stream: _Stream) -> Iterator[None]:
            log.append(("use", stream.name))
            self._on_copy_stream = True
            try:
                yield
            finally:
                self._on_copy_stream = False
                log.append(("unuse", stream.name))

        def pin_host(tensor: torch.Tensor) -> bool:
            log.append(("pin", tensor.data_ptr()))
            return self.register

        def pinned_empty(nbytes: int) -> torch.Tensor:
            log.append(("pinned_empty", nbytes))
            return torch.empty(nbytes, dtype=torch.uint8)

        set_attr(tiers, "_streamed", lambda device: True)
        set_attr(stwriter, "_streamed", lambda tensor: True)
        set_attr(accel, "new_stream", lambda device: _Stream(log, "copy"))
        set_attr(accel, "current_stream", lambda device: self.current)
        set_attr(accel, "new_event", lambda device: _Event(log))
        set_attr(accel, "use_stream", use_stream)
        set_attr(accel, "on_device", lambda device: contextlib.nullcontext())
        set_attr(accel, "pin_host", pin_host)
        set_attr(accel, "unpin_host", lambda tensor: log.append(("unpin", tensor.data_ptr())))
        set_attr(accel, "pinned_empty", pinned_empty)
        set_attr(torch.accelerator, "empty_host_cache", never_empty_the_pinned_cache)
        set_attr(torch.Tensor, "record_stream", lambda t, s: log.append(("record_stream", s.name)))
        self._wrap_data_movers(set_attr)

    def _wrap_data_movers(self, set_attr: Callable[[Any, str, Any], None]) -> None:
        log = self.log
        copy_, read = torch.Tensor.copy_, TensorSource.copy_into
        gather, allocate = tiers.all_gather_into, driver.allocate_bucket

        def logged_copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False):
            if self._on_copy_stream:
                log.append(("copy", src.data_ptr(), dst.data_ptr(), non_blocking))
            return copy_(dst, src, non_blocking=non_blocking)

        def logged_read(source, pieces, dest, dest_start):
            log.append(("read", dest.data_ptr()))
            return read(source, pieces, dest, dest_start)

        def logged_gather(output, shard, group, async_op=False):
            log.append(("all_gather", output.data_ptr()))
            return gather(output, shard, group, async_op=async_op)

        def logged_allocate(numel, dtype, device, *, ordinal, tier, huge_pages=True):
            buf = allocate(numel, dtype, device, ordinal=ordinal, tier=tier, huge_pages=huge_pages)
            log.append(("alloc", ordinal, buf.data_ptr(), buf.nbytes))
            return buf

        set_attr(torch.Tensor, "copy_", logged_copy)
        set_attr(TensorSource, "copy_into", logged_read)
        set_attr(tiers, "all_gather_into", logged_gather)
        set_attr(driver, "allocate_bucket", logged_allocate)


def _bucket_of(log: list[tuple], ptr: int) -> int:
    """The ordinal of the bucket whose memory holds ``ptr``."""
    (ordinal,) = [o for kind, o, start, n, *_ in _kinds(log, "alloc") if start <= ptr < start + n]
    return ordinal


def _kinds(log: list[tuple], kind: str) -> list[tuple]:
    return [e for e in log if e[0] == kind]


# ------------------------------------------------- the allocator's cache after the flatten
def _count_empty_cache() -> list[torch.device]:
    calls: list[torch.device] = []
    real = accel.empty_cache

    def counting(device: torch.device) -> None:
        calls.append(device)
        real(device)

    accel.empty_cache = counting
    return calls


def _empty_cache_counts(kind: str) -> dict:
    calls = _count_empty_cache()
    device = this_device(kind)
    counts = {}
    for name, model in (("device", UnevenNet().to(device)), ("host", UnevenNet())):
        calls.clear()
        flat = flatten_parameters(model, config=_config(device=kind))
        counts[name] = (flat.report.tiers, len(calls), {d.type for d in calls})
    return counts


def test_empty_cache_once_after_a_flatten_onto_an_accelerator(emu_run, monkeypatch):
    for r in emu_run:
        assert r["empty_cache"]["device"] == (("device",), 1, {"emu"}), r
        assert r["empty_cache"]["host"] == (("sharded",), 1, {"emu"}), r
    calls: list[torch.device] = []
    monkeypatch.setattr(accel, "empty_cache", calls.append)
    flat = flatten_parameters(UnevenNet(), config=_config(device="cpu"))
    assert flat.report.tiers == ("cpu",) and calls == []  # host buffers: never


def _allocate_only_cases(kind: str) -> dict:
    device = this_device(kind)
    state = emulated.installed()
    with torch.device("meta"):
        sizing = UnevenNet()
    flat = flatten_parameters(sizing, config=_config(device=kind), allocate_only=True)
    buckets = sum(b.nbytes for g in flat.groups for b in g.buckets)
    largest = max(b.nbytes for g in flat.groups for b in g.buckets)
    masters = sum(g.master.nbytes for g in flat.groups)
    del flat, sizing
    gc.collect()
    out: dict[str, Any] = {"buckets": buckets, "masters": masters}
    # The fp32 master and gradient shards, and every bucket: nothing on the device is freed.
    need = buckets + 2 * masters
    old_need = largest + 2 * masters  # one bucket, as if the params were on the device
    assert old_need < buckets + masters  # what the flatten itself allocates
    for name, room in (("old", old_need), ("short", need - 1), ("exact", need)):
        with torch.device("meta"):
            model = UnevenNet()
        base = accel.memory_allocated(device)
        state.set_capacity(base + room)
        accel.reset_peak_memory_stats(device)
        try:
            flat = flatten_parameters(model, config=_config(device=kind), allocate_only=True)
            out[name] = ("ok", flat.report.tiers, flat.report.tier_reason)
        except DeviceOutOfMemoryError as error:
            out[name] = ("oom", str(error))
        out[name + " peak"] = accel.max_memory_allocated(device) - base
        out[name + " on"] = sorted({p.device.type for p in model.parameters()})
        flat = None
        del model
        gc.collect()
        state.set_capacity(1 << 40)
    return out


def test_allocate_only_counts_every_bucket_when_params_hold_no_device_memory(
    emu_run,
):
    """``allocate_only`` used to be decided as params on the device (one bucket at a time);
    params on the meta device free nothing, so every bucket is new device memory. With the
    room the old decision asked for, it used to start, run out at a later bucket and leave
    params bound to host images; one byte short of the real need, it used to leave no
    room for the gradient shard. Now both are refused before anything is touched; with
    exactly the need, the exact peak is every bucket plus the master shard."""
    for r in (r["allocate_only"] for r in emu_run):
        for case in ("old", "short"):
            assert r[case][0] == "oom" and "nothing was changed" in r[case][1], r
            assert r[case + " peak"] == 0 and r[case + " on"] == ["meta"], r
        assert r["exact"][0] == "ok" and r["exact"][1] == ("device",), r
        assert "allocate_only" in r["exact"][2], r
        assert r["exact peak"] == r["buckets"] + r["masters"], r
        assert r["exact on"] == ["emu"], r


# ------------------------------------------------------------- only flatzero's pinned pages
def _check_pins_released(log: list[tuple], slots: int) -> None:
    pins = [e[1] for e in _kinds(log, "pin")]
    unpins = [e[1] for e in _kinds(log, "unpin")]
    assert len(pins) == slots and len(set(pins)) == slots, log
    assert sorted(unpins) == sorted(pins), "each of flatzero's buffers unpinned once, no other"
    last_copy = max(i for i, e in enumerate(log) if e[0] == "copy")
    first_unpin = min(i for i, e in enumerate(log) if e[0] == "unpin")
    assert first_unpin > last_copy
    assert not _kinds(log, "pinned_empty")


def test_flatzero_unpins_only_its_own_staging(monkeypatch, tmp_path: Path):
    """The upload ring and the checkpoint writer's chunks are page-locked by registration
    and unpinned one by one at the end; the process-wide pinned cache (a DataLoader's
    pinned batches) is never emptied: the fake raises if it is."""
    recorder = _Recorder()
    recorder.install(monkeypatch.setattr)
    model = UnevenNet()
    before = host_copy(model)
    flat = flatten_parameters(model, config=_config(tier="host", device="cpu"))
    assert unchanged(model, before) == [] and flat.report.tiers == ("host",)
    _check_pins_released(recorder.log, slots=2)
    for ring_slot in {e[1] for e in _kinds(recorder.log, "copy")}:
        assert ring_slot in {e[1] for e in _kinds(recorder.log, "pin")}  # copies read pinned

    recorder.log.clear()
    monkeypatch.setattr(stwriter, "_staged", lambda tensor: True)
    monkeypatch.setattr(stwriter, "_CHUNK_BYTES", 16)
    data = torch.arange(13, dtype=torch.float32)
    with stwriter.SafetensorsWriter(
        tmp_path / "x.safetensors", [TensorEntry("a", data.dtype, (13,))]
    ) as writer:
        writer.write("a", data)
    _check_pins_released(recorder.log, slots=2)


def test_without_host_registration_torch_pinned_cache_is_kept(monkeypatch):
    """A backend that cannot register host memory gets staging from torch's pinned caching
    allocator; at the end it goes back to that cache, which is not emptied."""
    recorder = _Recorder(register=False)
    recorder.install(monkeypatch.setattr)
    model = UnevenNet()
    before = host_copy(model)
    flatten_parameters(model, config=_config(tier="host", device="cpu"))
    assert unchanged(model, before) == []
    assert len(_kinds(recorder.log, "pinned_empty")) == 2
    assert not _kinds(recorder.log, "unpin")


class _Runtime:
    """``torch.cuda.cudart()`` as the seam sees it: register and unregister, logged."""

    def __init__(self, code: int = 0) -> None:
        self.calls: list[tuple] = []
        self.code = code

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", ptr, nbytes, flags))
        return self.code

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0


def test_pin_host_registers_exactly_the_tensor(monkeypatch, caplog):
    runtime = _Runtime()
    module = type("Module", (), {"cudart": staticmethod(lambda: runtime)})()
    monkeypatch.setattr(accel, "accelerator_type", lambda: "cuda")
    monkeypatch.setattr(accel, "device_module", lambda device: module)
    buffer = mapped_host(4096)  # pages of its own (a heap tensor may share one: refused)
    assert accel.pin_host(buffer)
    accel.unpin_host(buffer)
    assert runtime.calls == [
        ("register", buffer.data_ptr(), 4096, 1),
        ("unregister", buffer.data_ptr()),
    ]
    runtime.code = 2  # cudaErrorMemoryAllocation: the page-locked limit
    with caplog.at_level(logging.WARNING):
        assert not accel.pin_host(buffer)
    assert "could not page-lock 4096 bytes" in caplog.text
    monkeypatch.setattr(accel, "device_module", lambda device: object())  # no cudart
    assert not accel.pin_host(buffer)


# -------------------------------------------------- a fill error on one rank, every rank
def _failing_read(read: Callable, at_bucket: int) -> Callable:
    """``read`` (``TensorSource.copy_into``), raising when it reads bucket ``at_bucket``."""

    def failing(source, pieces, dest, dest_start):
        if any(p.bucket == at_bucket for p in pieces):
            raise OSError(f"injected read error at bucket {at_bucket}")
        return read(source, pieces, dest, dest_start)

    return failing


def _flatten_outcome(model: torch.nn.Module, config: FlattenConfig) -> dict:
    """What ``flatten_parameters(model)`` raised, and which params changed value."""
    before = host_copy(model)
    try:
        flatten_parameters(model, config=config)
    except Exception as error:
        return {
            "type": type(error).__name__,
            "message": str(error),
            "cause": repr(error.__cause__),
            "changed": unchanged(model, before),
        }
    return {"type": None, "changed": unchanged(model, before)}


def _read_errors(rank: int, buckets: list[int], tier: str) -> list[dict]:
    read = TensorSource.copy_into
    config = _config(tier=tier, device="cpu")
    results = []
    for at_bucket in buckets:
        TensorSource.copy_into = _failing_read(read, at_bucket) if rank == 1 else read
        results.append(_flatten_outcome(UnevenNet(), config))
    TensorSource.copy_into = read
    return results


def test_a_read_error_on_one_rank_raises_on_every_rank_gloo(gloo_run):
    """Rank 1 of 3 fails to read bucket k: every rank raises the same error, naming rank 1
    and the original error, within the collective timeout (it used to leave ranks 0 and 2
    in the all-gather until the timeout); no parameter loses its data."""
    buckets = READ_ERROR_BUCKETS
    per_rank = [r["read_errors"] for r in gloo_run]
    for k, results in zip(buckets, zip(*per_rank, strict=True), strict=True):
        messages = {r["message"] for r in results}
        assert len(messages) == 1, results
        (message,) = messages
        assert all(r["type"] == "BucketFillError" for r in results), results
        assert f"rank 1 at bucket {k} (OSError: injected read error at bucket {k})" in message
        assert "every parameter still holds its data" in message
        assert all(r["changed"] == [] for r in results), results
        assert "OSError" in per_rank[1][buckets.index(k)]["cause"]  # the original, chained


def test_a_read_error_in_a_local_tier_raises_on_every_rank(gloo_run):
    """The same in a tier that fills locally (``cpu``): the failing rank used to raise its
    own error alone while the others waited in the group's closing agreement, until its
    process exited and gloo reported a lost peer; the failure now rides on that agreement."""
    results = [r["local_read_error"][0] for r in gloo_run]
    assert all(r["type"] == "BucketFillError" for r in results), results
    assert len({r["message"] for r in results}) == 1, results
    assert "rank 1 at bucket 2 (OSError: injected read error at bucket 2)" in results[0]["message"]
    assert all(r["changed"] == [] for r in results), results


def _checkpoint_read_error(rank: int, kind: str, path: str) -> dict:
    from flatzero import load_flat

    reads = 0
    read = CheckpointSource.copy_into

    def failing(source, pieces, dest, dest_start):
        nonlocal reads
        reads += 1
        if rank == 1 and reads == 3:  # rank 1's third read, mid-way
            raise OSError(5, "Input/output error", path)
        return read(source, pieces, dest, dest_start)

    CheckpointSource.copy_into = failing
    with torch.device("meta"):
        model = UnevenNet()
    reference = UnevenNet()
    try:
        load_flat(model, path, config=_config(device=kind))
    except BucketFillError as error:
        kept = all(
            p.device.type == "meta" or torch.equal(p.detach().cpu(), r)
            for p, r in zip(model.parameters(), reference.parameters(), strict=True)
        )
        return {"message": str(error), "kept": kept}
    finally:
        CheckpointSource.copy_into = read
    return {"message": None}


def test_a_checkpoint_read_error_on_one_rank_raises_on_every_rank_emulated(emu_run):
    """``load_flat`` on the emulated device (the sharded tier, a safetensors source): rank
    1's third read fails; both ranks raise the same error naming it, and every param is
    either still on the meta device or holds the checkpoint's values."""
    results = [r["checkpoint_read_error"] for r in emu_run]
    assert results[0]["message"] is not None and results[0]["message"] == results[1]["message"]
    assert "rank 1 at bucket" in results[0]["message"]
    assert "OSError: [Errno 5] Input/output error" in results[0]["message"]
    assert all(r["kept"] for r in results), results


# ------------------------------------------ upload of bucket k + 1 while bucket k gathers
@contextlib.contextmanager
def _small_chunks() -> Iterator[None]:
    """Staging chunks of 256 bytes (64 fp32 elements): several per slice, the ring reused."""
    default, tiers.STAGING_CHUNK_BYTES = tiers.STAGING_CHUNK_BYTES, 256
    try:
        yield
    finally:
        tiers.STAGING_CHUNK_BYTES = default


def _overlap() -> dict:
    """The recorded sharded flatten (this rank's log) and whether its buckets are bitwise
    those of the ``cpu`` tier. Installs the recorder for good: the rank's last part."""
    reference = flatten_parameters(UnevenNet(), config=_config(tier="cpu", device="cpu"))
    recorder = _Recorder()
    recorder.install(setattr)
    model = UnevenNet()
    before = host_copy(model)
    with _small_chunks():
        flat = flatten_parameters(model, config=_config(tier="sharded", device="cpu"))
    return {
        "log": recorder.log,
        "tiers": flat.report.tiers,
        "changed": unchanged(model, before),
        "bitwise": _bucket_bytes(flat) == _bucket_bytes(reference),
    }


def _check_overlap(log: list[tuple]) -> None:
    """The order the overlap needs, from one rank's log."""
    index = {id(e): i for i, e in enumerate(log)}
    copies = _kinds(log, "copy")
    gathers = {_bucket_of(log, e[1]): index[id(e)] for e in _kinds(log, "all_gather")}
    buckets = sorted(gathers)
    assert len(buckets) >= 4 and buckets == list(range(len(buckets)))
    copies_of = {b: [index[id(c)] for c in copies if _bucket_of(log, c[2]) == b] for b in buckets}
    assert all(len(copies_of[b]) >= 2 for b in buckets)  # several chunks per slice
    for i in (index[id(c)] for c in copies):  # every copy on the copy stream, then its event
        assert log[i - 1] == ("use", "copy") and log[i + 1][0] == "record", log[i - 1 : i + 2]
        assert log[i + 1][2] == "copy"
    for b in buckets:
        last = copies_of[b][-1]
        event = log[last + 1][1]
        # The all-gather of bucket b waits for its own slice's last copy event.
        assert ("wait_event", "current", event) in log[last : gathers[b]], b
        if b + 1 in gathers:
            # Bucket b + 1's whole upload (and the copy stream's wait for the current
            # stream before it) is queued before bucket b's all-gather: it cannot wait for
            # that all-gather, so the two overlap.
            assert copies_of[b + 1][-1] < gathers[b], b
    # A ring slot is refilled only after the event of the copy that read it completed.
    last_event: dict[int, int] = {}
    for i, entry in enumerate(log):
        if entry[0] == "copy":
            last_event[entry[1]] = log[i + 1][1]
        elif entry[0] == "read" and entry[1] in last_event:
            event = last_event.pop(entry[1])
            assert ("event_sync", event) in log[:i], (i, entry)


def test_upload_of_the_next_bucket_overlaps_the_all_gather(gloo_run):
    for r in (r["overlap"] for r in gloo_run):
        assert r["tiers"] == ("sharded",) and r["changed"] == [] and r["bitwise"]
        _check_overlap(r["log"])
        _check_pins_released(r["log"], slots=2)


def _emulated_pipeline(kind: str) -> dict:
    reference = flatten_parameters(UnevenNet(), config=_config(tier="cpu", device="cpu"))
    model = UnevenNet()
    before = host_copy(model)
    with _small_chunks():
        flat = flatten_parameters(model, config=_config(device=kind))
    return {
        "tiers": flat.report.tiers,
        "changed": unchanged(model, before),
        "on": sorted({p.device.type for p in model.parameters()}),
        "bitwise": _bucket_bytes(flat) == _bucket_bytes(reference),
    }


def test_pipelined_sharded_upload_is_bitwise_on_the_emulated_device(emu_run):
    for r in (r["pipeline"] for r in emu_run):
        assert r["tiers"] == ("sharded",) and r["on"] == ["emu"], r
        assert r["changed"] == [] and r["bitwise"], r


# ----------------------------------------------------------------- the multi-rank runs
READ_ERROR_BUCKETS = [0, 2, 5]  # the first, a middle and the last of 6


def _emulated_worker(rank: int, world_size: int, kind: str, path: str) -> dict:
    return {
        "empty_cache": _empty_cache_counts(kind),
        "allocate_only": _allocate_only_cases(kind),
        "pipeline": _emulated_pipeline(kind),
        "checkpoint_read_error": _checkpoint_read_error(rank, kind, path),
    }


@pytest.fixture(scope="module")
def emu_run(tmp_path_factory) -> list[dict]:
    """The cache, the fill errors and the upload pipeline on 2 ranks of the emulated
    accelerator, in one run."""
    path = tmp_path_factory.mktemp("staging") / "model.safetensors"
    save_file({n: p.detach().contiguous() for n, p in UnevenNet().named_parameters()}, path)
    return launch("emu", _emulated_worker, 2, str(path), timeout_s=30)


def _gloo_worker(rank: int, world_size: int) -> dict:
    return {
        "read_errors": _read_errors(rank, READ_ERROR_BUCKETS, "sharded"),
        "local_read_error": _read_errors(rank, [2], "cpu"),
        "overlap": _overlap(),
    }


@pytest.fixture(scope="module")
def gloo_run() -> list[dict]:
    """The fill errors and the upload pipeline on 3 gloo ranks (host buffers), in one run;
    a rank that waited in a collective the others never joined would fail it after 20 s."""
    return run_ranks(_gloo_worker, 3, timeout_s=20)
