"""An asynchronous save's snapshot buffer on 4 KiB pages against 2 MiB pages.

Per page size, in one process (the buffers alternate, three times each):
- ``first``: the first copy of 5 GiB into a new buffer (its first touch) and a later copy;
- ``write``: an ``O_DIRECT`` write + fsync of the buffer (64 MiB calls, as the save's
  writer issues them): its wall, GB/s and the writing thread's CPU seconds, and the
  seconds a 2-thread bf16 GEMM loop running meanwhile lost against its speed just before.

    python benchmarks/probes/snapshot_pages.py first 0   # 4 KiB pages, one fresh process
    python benchmarks/probes/snapshot_pages.py first 1   # 2 MiB pages
    python benchmarks/probes/snapshot_pages.py write DIR # both, writing DIR/probe.bin
"""

import ctypes
import os
import sys
import threading
import time
from pathlib import Path

import torch

from flatzero.hostmem import mapped_host

NBYTES = 5 * 2**30
WRITE_BYTES = 64 * 2**20


def first_touch(huge: bool) -> None:
    """The first and a later copy of ``NBYTES`` into a new buffer."""
    source = torch.full((NBYTES,), 7, dtype=torch.uint8)
    buffer = mapped_host(NBYTES, huge_pages=huge)
    seconds = []
    for _ in range(2):
        t0 = time.perf_counter()
        ctypes.memmove(buffer.data_ptr(), source.data_ptr(), NBYTES)
        seconds.append(time.perf_counter() - t0)
    print(f"huge pages {huge}: first copy {seconds[0]:.2f} s, again {seconds[1]:.2f} s")


def _write(buffer: torch.Tensor, path: Path, out: list[float]) -> None:
    view = memoryview(buffer.numpy())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
    t0, c0 = time.perf_counter(), time.thread_time()
    at = 0
    while at < NBYTES:
        at += os.write(fd, view[at : at + WRITE_BYTES])
    os.fsync(fd)
    os.close(fd)
    out += [time.perf_counter() - t0, time.thread_time() - c0]


def write_interference(directory: Path) -> None:
    """Per page size, three alternations: the write and the GEMM time it cost."""
    torch.set_num_threads(2)
    a, b = (torch.randn(2048, 2048, dtype=torch.bfloat16) for _ in range(2))
    buffers = {huge: mapped_host(NBYTES, huge_pages=huge).fill_(1) for huge in (False, True)}
    path = directory / "probe.bin"
    for _ in range(3):
        for huge, buffer in buffers.items():
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < 3:
                a @ b
                n += 1
            rate = n / (time.perf_counter() - t0)
            out: list[float] = []
            writer = threading.Thread(target=_write, args=(buffer, path, out))
            writer.start()
            n, t0 = 0, time.perf_counter()
            while writer.is_alive():
                a @ b
                n += 1
            elapsed = time.perf_counter() - t0
            print(
                f"huge pages {huge}: write {out[0]:.2f} s ({NBYTES / out[0] / 1e9:.2f} GB/s), "
                f"writer CPU {out[1]:.3f} s; GEMM lost {elapsed - n / rate:.2f} s of {elapsed:.2f}"
            )
    path.unlink()


if __name__ == "__main__":
    if sys.argv[1] == "first":
        first_touch(sys.argv[2] == "1")
    else:
        write_interference(Path(sys.argv[2]))
