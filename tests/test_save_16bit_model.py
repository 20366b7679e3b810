"""``engine.save_16bit_model`` streams the weights from the flat buckets.

- The file loads with ``load_state_dict(strict=True)`` and holds the trained weights bit for
  bit, keyed exactly as ``model.state_dict()`` (tied weights, a frozen param and buffers
  included), at 1 and 2 ranks (gloo), fp32 and bf16, ``.bin`` (``torch.save`` format) and
  ``.safetensors``; ``from_pretrained`` loads both for a transformers model.
- Extra memory: the host memory held by tensors created during the save never exceeds
  one block (a bucket, or a tensor outside the buckets), with blocks copied as from a
  device and without; there is no whole-state-dict clone.
- A failing write on rank 0 raises on both ranks (no hang: each rank is killed by a
  watchdog after 120 s); a write that fails (file size limit: EFBIG) or a process that dies
  (SIGXFSZ) mid-write leaves the final name as it was and no temporary file behind.
"""

from __future__ import annotations

import faulthandler
import hashlib
import resource
import signal
import weakref
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from flatzero.launch import run_ranks
from test_engine import ds_config, make_model, train

NAMES = ("pytorch_model.bin", "model.safetensors")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WATCHDOG_S = 120
"""A rank still running after this many seconds dumps its stacks and exits (a hang)."""


def _model() -> torch.nn.Module:
    """The engine tests' tiny Llama (tied embeddings, one frozen param) with a persistent
    float buffer and an int buffer."""
    model = make_model()
    model.register_buffer("scale", torch.linspace(0.5, 1.5, 7))
    model.register_buffer("counter", torch.arange(5))
    return model


def _engine(dtype: str, world_size: int, steps: int = 2) -> tuple[Any, torch.nn.Module]:
    """A trained engine (ZeRO-2, 2000-element buckets) and its model."""
    import flatzero

    extra = {"bf16": {"enabled": True}} if dtype == "bf16" else {}
    model = _model()
    engine, _, _, _ = flatzero.initialize(model=model, config=ds_config(2, world_size, **extra))
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    train(engine, rank, world_size, steps=steps)
    return engine, model


def _read(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return load_file(path)
    return torch.load(path, weights_only=True)


def _check(path: Path, model: torch.nn.Module, frozen: bool = True) -> dict[str, Any]:
    """What the test asserts about one saved file, against the trained ``model``."""
    expected = model.state_dict()
    if not frozen:
        expected.pop("model.layers.0.input_layernorm.weight")
    saved = _read(path)
    keys = list(saved) if path.suffix == ".bin" else sorted(saved)
    fresh = _model().to(dtype=expected["lm_head.weight"].dtype)
    result = fresh.load_state_dict(saved, strict=frozen)
    out = {
        "keys_match": keys == (list(expected) if path.suffix == ".bin" else sorted(expected)),
        "bitwise": all(
            saved[k].dtype == v.dtype and torch.equal(saved[k], v) for k, v in expected.items()
        ),
        "loaded": frozen or list(result.missing_keys) == ["model.layers.0.input_layernorm.weight"],
    }
    if path.suffix == ".bin":
        mapped = torch.load(path, weights_only=True, mmap=True)
        out["mmap"] = all(torch.equal(mapped[k], v) for k, v in expected.items())
        out["tied"] = mapped["lm_head.weight"].data_ptr() == (
            mapped["model.embed_tokens.weight"].data_ptr()
        )
    return out


def _data_checks(rank: int, ws: int, root: Path) -> dict[str, Any]:
    """Save and check every (dtype, file name); every rank checks the file against its
    own model (every rank holds all params)."""
    out: dict[str, Any] = {}
    for dtype in DTYPES:
        engine, model = _engine(dtype, ws)
        for name in NAMES:
            directory = root / f"ws{ws}" / dtype
            assert engine.save_16bit_model(directory, name) is True
            out[f"{dtype}/{name}"] = _check(directory / name, model)
            directory = root / f"ws{ws}" / f"{dtype}-trainable"
            engine.save_16bit_model(directory, name, exclude_frozen_parameters=True)
            out[f"{dtype}/{name}/trainable"] = _check(directory / name, model, frozen=False)
        engine.destroy()
    return out


def _error_of(fn) -> str:
    try:
        fn()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _file_size_limit(limit: int | None) -> None:
    """Writes beyond ``limit`` bytes fail (EFBIG, or SIGXFSZ unless it is ignored); None:
    back to the hard limit."""
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard if limit is None else limit, hard))


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".tmp-"))


def _error_checks(rank: int, ws: int, root: Path) -> dict[str, Any]:
    """An unwritable directory, then a write that fails midway, on rank 0."""
    out: dict[str, Any] = {}
    engine, _ = _engine("fp32", ws, steps=1)
    blocker = root / "errors" / "a_file"
    if rank == 0:
        blocker.parent.mkdir(parents=True, exist_ok=True)
        blocker.write_text("not a directory")
    torch.distributed.barrier()
    out["unwritable"] = _error_of(lambda: engine.save_16bit_model(blocker / "out"))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    for name in NAMES:
        directory = root / "errors" / "full"
        engine.save_16bit_model(directory, name)
        before = (directory / name).read_bytes()
        train(engine, rank, ws, steps=1)  # new weights: a complete new file would differ
        if rank == 0:
            _file_size_limit(len(before) // 2)
        try:
            out[f"full/{name}"] = _error_of(partial(engine.save_16bit_model, directory, name))
        finally:
            _file_size_limit(None)
        out[f"full/{name}/unchanged"] = (directory / name).read_bytes() == before
        out[f"full/{name}/leftovers"] = _leftovers(directory)
        torch.distributed.barrier()  # both ranks looked before the next save starts
    engine.destroy()
    return out


def _watched(checks, rank: int, ws: int, root: str) -> dict[str, Any]:
    """``checks`` on a rank that exits, with its stacks dumped, after ``WATCHDOG_S``."""
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    try:
        return checks(rank, ws, Path(root))
    finally:
        faulthandler.cancel_dump_traceback_later()


def _data_rank(rank: int, ws: int, root: str) -> dict[str, Any]:
    return _watched(_data_checks, rank, ws, root)


def _error_rank(rank: int, ws: int, root: str) -> dict[str, Any]:
    return _watched(_error_checks, rank, ws, root)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict[int, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("save16")
    return {ws: run_ranks(_data_rank, ws, str(root), timeout_s=60) for ws in (1, 2)}


@pytest.fixture(scope="module")
def failures(tmp_path_factory) -> list[dict[str, Any]]:
    return run_ranks(_error_rank, 2, str(tmp_path_factory.mktemp("save16")), timeout_s=60)


@pytest.mark.parametrize("ws", [1, 2])
def test_file_holds_the_trained_weights_bitwise(worlds, ws):
    for rank, out in enumerate(worlds[ws]):
        for dtype in DTYPES:
            for name in NAMES:
                full = {"keys_match": True, "bitwise": True, "loaded": True}
                if name.endswith(".bin"):
                    full.update(mmap=True, tied=True)
                assert out[f"{dtype}/{name}"] == full, (rank, dtype, name)
                trainable = out[f"{dtype}/{name}/trainable"]
                assert trainable == full, (rank, dtype, name)


def test_failed_write_on_rank0_raises_on_both_ranks(failures):
    zero, one = failures
    path = "errors/a_file/out/pytorch_model.bin"
    assert zero["unwritable"].startswith("NotADirectoryError: [Errno 20] cannot write /")
    assert path in zero["unwritable"] and "Not a directory" in zero["unwritable"]
    assert one["unwritable"].startswith("RuntimeError: save_16bit_model: rank 0 failed to write")
    assert path in one["unwritable"] and "nothing was written under that name" in one["unwritable"]
    for name in NAMES:
        assert zero[f"full/{name}"].startswith("OSError: [Errno 27] cannot write /")
        assert "File too large" in zero[f"full/{name}"]
        assert one[f"full/{name}"].startswith("RuntimeError: save_16bit_model: rank 0 failed")


def test_failed_write_leaves_no_partial_file(failures):
    for rank, out in enumerate(failures):
        for name in NAMES:
            assert out[f"full/{name}/unchanged"], (rank, name)
            assert out[f"full/{name}/leftovers"] == [], (rank, name)


def _killed_mid_write(rank: int, ws: int, root: str, name: str) -> None:
    """Save once, then again with a file size limit whose signal kills the process."""
    engine, _ = _engine("fp32", ws, steps=1)
    engine.save_16bit_model(root, name)
    first = (Path(root) / name).read_bytes()
    (Path(root) / "first.sha256").write_text(hashlib.sha256(first).hexdigest())
    size = len(first)
    train(engine, rank, ws, steps=1)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    _file_size_limit(size // 2)
    engine.save_16bit_model(root, name)


@pytest.mark.parametrize("name", NAMES)
def test_process_killed_mid_write_leaves_the_old_file(tmp_path, name):
    root = tmp_path / "killed"
    with pytest.raises(RuntimeError, match="rank 0"):
        run_ranks(_killed_mid_write, 1, str(root), name, timeout_s=60)
    first = (root / "first.sha256").read_text()
    assert hashlib.sha256((root / name).read_bytes()).hexdigest() == first  # the old file
    assert "lm_head.weight" in _read(root / name)
    assert [p for p in _leftovers(root) if name in p]  # the killed write's temporary file


class _LiveHostBytes(TorchDispatchMode):
    """The host memory held by tensors that ops inside the mode allocate.

    An op output whose storage no input shares is an allocation; it counts until the last
    tensor seen on its storage (the output and views of it made inside the mode) is gone.

    Attributes:
        peak: the most bytes held at once.
        largest: the largest single allocation (bytes).
    """

    def __init__(self) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}
        self._users: dict[int, int] = {}
        self._live = self.peak = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.nbytes:
                self._track(t, inputs)
        return out

    def _track(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._sizes:
            if ptr in inputs:
                return  # a view of memory that was not allocated inside the mode
            self._sizes[ptr] = storage.nbytes()
            self._live += storage.nbytes()
            self.peak = max(self.peak, self._live)
            self.largest = max(self.largest, storage.nbytes())
        self._users[ptr] = self._users.get(ptr, 0) + 1
        weakref.finalize(tensor, self._release, ptr)

    def _release(self, ptr: int) -> None:
        self._users[ptr] -= 1
        if self._users[ptr] == 0:
            del self._users[ptr]
            self._live -= self._sizes.pop(ptr)


@pytest.fixture(scope="module")
def small_engine():
    engine, model = _engine("bf16", 1)
    yield engine, model
    engine.destroy()


def _block_bound(engine, model: torch.nn.Module) -> tuple[int, int]:
    """(the largest block: a bucket or a tensor outside the buckets, the state dict's
    bytes)."""
    buckets = [b for g in engine.optimizer.flat.groups for b in g.buckets]
    inside = {p.untyped_storage().data_ptr() for p in model.parameters() if p.requires_grad}
    state = model.state_dict()
    outside = [t for t in state.values() if t.untyped_storage().data_ptr() not in inside]
    bound = max(t.nbytes for t in [*buckets, *outside])
    return bound, sum(t.nbytes for t in state.values())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("copied", [False, True], ids=["host-buffers", "device-like-copies"])
def test_extra_memory_is_one_block(small_engine, tmp_path, monkeypatch, name, copied):
    engine, model = small_engine
    if copied:  # every block goes through the host copy a device bucket takes
        from flatzero.deepspeed.engine import weights16

        monkeypatch.setattr(weights16, "_in_host_memory", lambda tensor: False)
    bound, total = _block_bound(engine, model)
    assert bound < total / 4  # the bound tells a block from the state dict
    with _LiveHostBytes() as live:
        engine.save_16bit_model(tmp_path, name)
    assert live.peak <= bound and live.largest <= bound
    if copied:
        assert live.largest == bound  # the largest block was copied
    else:
        assert live.peak == 0  # written from the buffers, nothing materialised
    saved = _read(tmp_path / name)
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


def test_transformers_loads_both_files(tmp_path):
    transformers = pytest.importorskip("transformers")
    import flatzero
    from test_engine_hf import make

    model = make("llama")
    engine, _, _, _ = flatzero.initialize(model=model, config=ds_config(2, 1))
    train_ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(train_ids, labels=train_ids).loss)
    engine.step()
    for name in NAMES:
        directory = tmp_path / name
        engine.save_16bit_model(directory, name)
        model.config.save_pretrained(directory)
        loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
            directory, output_loading_info=True
        )
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        assert not info["mismatched_keys"], info
        theirs = loaded.state_dict()
        assert all(torch.equal(theirs[k], v) for k, v in model.state_dict().items()), name
    engine.destroy()


def test_extra_state_is_pickled_or_refused(tmp_path):
    from flatzero.deepspeed.engine.weights16 import plan_weights, write_weights

    bucket = torch.arange(8, dtype=torch.float32)
    state = {
        "w": bucket[2:6].view(2, 2),
        "extra": {"step": 3},
        "scalar": torch.tensor(5),
        "empty": torch.ones(0, 3),
        "t": torch.arange(6.0).view(2, 3).t(),  # not contiguous
    }
    plan = plan_weights(state, [bucket])
    assert [len(b.tensors) for b in plan.blocks] == [1, 1, 1, 1] and plan.blocks[0].source is bucket
    write_weights(tmp_path / "w.bin", plan)
    loaded = torch.load(tmp_path / "w.bin", weights_only=True)
    assert list(loaded) == list(state) and loaded["extra"] == {"step": 3}
    for key in ("w", "scalar", "empty", "t"):
        assert torch.equal(loaded[key], state[key]) and loaded[key].shape == state[key].shape
    with pytest.raises(TypeError, match=r"values that are not tensors \(\['extra'\]\)"):
        write_weights(tmp_path / "w.safetensors", plan)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.bin"]
    del state["extra"]
    write_weights(tmp_path / "w.safetensors", plan_weights(state, [bucket]))
    loaded = load_file(tmp_path / "w.safetensors")
    assert all(torch.equal(loaded[k], v) and loaded[k].shape == v.shape for k, v in state.items())
