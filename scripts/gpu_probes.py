"""The issue-41 probes on a real GPU: findings 3, 4 and 7, one JSON file each.

``python scripts/gpu_probes.py OUT_DIR``, run by ``scripts/gpu_check.sh``. Without CUDA
every probe writes ``{"skipped": "no CUDA"}`` and the script exits 0 (CI runs it so).

- ``latched_error.json`` (finding 3): two registrations of one page through torch's raw
  binding (the second fails with 712) and whether the next kernel launch raises that
  latched error; then the same through flatzero's seam (``accel.pin_host``), which must
  refuse without a runtime call, or clear what it latched, so that nothing raises.
- ``fork_pinned.json`` (finding 4): a 256 MiB ``hostmem.page_locked`` buffer and one from
  torch's pinned allocator, then ``fork``: whether the child has each mapped, and how long
  the fork took (Linux 5.9+ copies page-locked pages into the child at the fork).
- ``snapshot_registered.json`` (finding 7): an asynchronous save of a one-rank NCCL
  ZeroOptimizer, then the optimizer dropped: the page-locked bytes flatzero still holds
  (``accel.pinned_bytes``: 0 expected).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _kernel_raises() -> str | None:
    """The error a one-element kernel launch raises now (None: nothing)."""
    try:
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return None


def latched_error() -> dict[str, Any]:
    """Finding 3: a refused registration's latched error, raw and through the seam. The
    range is registered first behind the seam's back (so ``pin_host`` does not know it and
    asks the runtime, which refuses with 712): the seam must clear that error."""
    from flatzero import accel
    from flatzero.hostmem import mapped_host

    torch.ones(1, device="cuda")  # a context first
    runtime = torch.cuda.cudart()
    page = mapped_host(4 * 4096)
    raw = [int(runtime.cudaHostRegister(page.data_ptr(), page.nbytes, 1)) for _ in range(2)]
    raw_raise = _kernel_raises()
    _kernel_raises()  # whatever is left latched
    seam = accel.pin_host(page)
    seam_raise = _kernel_raises()
    runtime.cudaHostUnregister(page.data_ptr())
    return {
        "raw register codes": raw,
        "raw: next kernel raised": raw_raise,
        "seam pinned": seam,
        "seam: next kernel raised": seam_raise,
        "ok": raw[0] == 0 and raw[1] != 0 and seam is False and seam_raise is None,
    }


def _fork_sees(addresses: list[int]) -> tuple[list[bool], float]:
    """Whether a forked child has each address mapped, and the fork's seconds."""
    read, write = os.pipe()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        with open("/proc/self/maps") as maps:
            spans = [[int(x, 16) for x in line.split()[0].split("-")] for line in maps]
        os.write(write, bytes(int(any(lo <= a < hi for lo, hi in spans)) for a in addresses))
        os._exit(0)
    forked = time.perf_counter() - t0
    os.close(write)
    seen = os.read(read, 64)
    os.close(read)
    os.waitpid(pid, 0)
    return [bool(b) for b in seen], forked


def fork_pinned() -> dict[str, Any]:
    """Finding 4: page-locked buffers and a fork."""
    from flatzero.hostmem import page_locked

    nbytes = 256 * 2**20
    ours = page_locked(nbytes, device=torch.device("cuda", torch.cuda.current_device()))
    ours.data.fill_(1)
    torchs = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    seen, forked = _fork_sees([ours.data.data_ptr(), torchs.data_ptr()])
    ours.release()
    return {
        "page_locked registered": ours.pinned,
        "child maps page_locked": seen[0],
        "child maps torch pin_memory": seen[1],
        "fork seconds": forked,
        "ok": ours.pinned and not seen[0],
    }


def snapshot_registered() -> dict[str, Any]:
    """Finding 7: the async save's snapshot after the optimizer is gone."""
    import torch.distributed as dist

    from flatzero import ZeroOptimizer, accel
    from flatzero.checkpoint import save_checkpoint
    from flatzero.checkpoint.checkpointer import wait_for_save
    from flatzero.ports import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(4))).cuda()
        opt = ZeroOptimizer(model.parameters(), optimizer=torch.optim.AdamW, stage=2)
        model(torch.randn(8, 512, device="cuda")).sum().backward()
        opt.step()
        with tempfile.TemporaryDirectory() as root:
            save_checkpoint(root, opt, asynchronous=True)
            wait_for_save(opt)
            saved = accel.pinned_bytes()
            opt.close()
            del opt
            gc.collect()
        left = accel.pinned_bytes()
    finally:
        dist.destroy_process_group()
    return {
        "pinned after the save": saved,
        "pinned after the optimizer went": left,
        "ok": saved > 0 and left == 0,
    }


PROBES: dict[str, Callable[[], dict[str, Any]]] = {
    "latched_error": latched_error,
    "fork_pinned": fork_pinned,
    "snapshot_registered": snapshot_registered,
}


def main(out: Path) -> int:
    """Run every probe; one JSON file each under ``out``. Returns 1 when a probe that ran
    found its finding still there or failed, else 0."""
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name, probe in PROBES.items():
        if not torch.cuda.is_available():
            result: dict[str, Any] = {"skipped": "no CUDA"}
        else:
            try:
                result = probe()
            except Exception as error:  # a probe's failure is its result
                result = {"error": f"{type(error).__name__}: {error}", "ok": False}
            failed += not result.get("ok", False)
        (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    return int(failed > 0)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else ".")))
