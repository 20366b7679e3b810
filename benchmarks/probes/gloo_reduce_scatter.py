"""gloo's reduce-scatter against chunked reduces through staging slots, in host memory.

Each rank holds one fp32 bucket of ``2**26`` elements (256 MiB), as stage 1's flat
gradient buffer does, and sums it over ranks into its own slice, alternating ``REPEATS``
times in one launch:
- ``reduce_scatter_tensor``: torch's gloo reduce-scatter of the bucket;
- ``chunked reduces``: what ``Stage1Reducer.finish`` does on gloo in host memory: each
  rank's slice in chunks of ``CHUNK`` elements copied into one of two preallocated slots
  (the default staging budget, 256 MiB in two slots), summed onto the slice's owner with
  ``dist.reduce`` and copied into the owner's shard, two in flight.
Per way: the slowest rank's seconds, and rank 0's resident-set high-water mark above the
resident set before (heap trimmed, mark reset). Results are checked against each other.

    PYTHONPATH=benchmarks python -m torch.distributed.run --standalone --nproc-per-node 2 \
        benchmarks/probes/gloo_reduce_scatter.py

Prints a table and one JSON line.
"""

import json
import os
import statistics

import torch
import torch.distributed as dist
from collective_probe import measure, print_table

from flatzero_bench.common.machine import describe_host
from flatzero_bench.common.provenance import utc_timestamp

NUMEL = 2**26
CHUNK = 2**25
REPEATS = 4


def main() -> None:
    load_before = os.getloadavg()
    date = utc_timestamp()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = NUMEL - NUMEL % world
    piece = numel // world
    full = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    shard = torch.empty(piece)
    slots = [torch.zeros(CHUNK) for _ in range(2)]  # allocated once, as the pool's are

    def torch_reduce_scatter() -> None:
        dist.reduce_scatter_tensor(shard, full)

    def chunked_reduces() -> None:
        in_flight: list[tuple] = []

        def land(work, dst, src) -> None:
            work.wait()
            if dst is not None:
                dst.copy_(src)

        count = 0
        for owner in range(world):
            for lo in range(0, piece, CHUNK):
                hi = min(lo + CHUNK, piece)
                if len(in_flight) == len(slots):
                    land(*in_flight.pop(0))
                staged = slots[count % len(slots)][: hi - lo]
                staged.copy_(full[owner * piece + lo : owner * piece + hi])
                work = dist.reduce(staged, dst=owner, async_op=True)
                in_flight.append((work, shard[lo:hi] if owner == rank else None, staged))
                count += 1
        for item in in_flight:
            land(*item)

    ways = {"reduce_scatter_tensor": torch_reduce_scatter, "chunked reduces": chunked_reduces}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    peaks: dict[str, list[int]] = {name: [] for name in ways}
    results = {}
    for _ in range(REPEATS):
        for name, run in ways.items():
            shard.zero_()
            elapsed, peak = measure(run)
            seconds[name].append(elapsed)
            peaks[name].append(peak)
            results[name] = shard.clone()
    largest = float((results["reduce_scatter_tensor"] - results["chunked reduces"]).abs().max())
    if largest > 1e-4:
        raise AssertionError(f"the two ways differ by {largest}")
    if rank == 0:
        title = (
            f"{world} ranks, one fp32 bucket of {numel * 4 / 2**20:.0f} MiB, {REPEATS} alternations"
        )
        print_table(title, seconds, peaks)
        ratio = statistics.median(seconds["chunked reduces"]) / statistics.median(
            seconds["reduce_scatter_tensor"]
        )
        print(f"chunked reduces / reduce_scatter_tensor: {ratio:.3f}x")
        print(
            json.dumps(
                {
                    "probe": "gloo_reduce_scatter",
                    "command": "python -m torch.distributed.run --standalone "
                    f"--nproc-per-node {world} benchmarks/probes/gloo_reduce_scatter.py",
                    "date": date,
                    "machine": describe_host(load_before),
                    "world_size": world,
                    "bucket_bytes": numel * 4,
                    "chunk_elements": CHUNK,
                    "seconds": seconds,
                    "peak_rss_gain_bytes": peaks,
                    "largest_difference": largest,
                    "chunked_over_reduce_scatter": ratio,
                }
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
