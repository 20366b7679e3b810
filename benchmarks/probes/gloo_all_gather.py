"""gloo's all-gather against one in-place broadcast per rank, in host memory.

Each rank holds ``BUCKETS`` bf16 buckets of ``2**26`` elements (128 MiB) and fills its
own slice; then, alternating the two ways ``REPEATS`` times in one launch, all buckets
are gathered asynchronously as a step's end does (``comm.all_gather_buckets_from_own_slices``):
- ``all_gather_into_tensor``: torch's gloo all-gather of each bucket;
- ``broadcasts``: ``comm.all_gather_into``'s path on gloo, each rank's slice broadcast in
  place from its owner.
Per way: the slowest rank's seconds, and rank 0's resident-set high-water mark above the
resident set before (heap trimmed, mark reset; ``/proc/self/status``). Every result is
checked against the expected values. Run it under torchrun:

    PYTHONPATH=benchmarks python -m torch.distributed.run --standalone --nproc-per-node 2 \
        benchmarks/probes/gloo_all_gather.py

Prints a table and one JSON line.
"""

import json
import os
import statistics

import torch
import torch.distributed as dist
from collective_probe import measure, print_table

from flatzero.comm import all_gather_into
from flatzero_bench.common.machine import describe_host
from flatzero_bench.common.provenance import utc_timestamp

BUCKETS = 5
NUMEL = 2**26
REPEATS = 4


def main() -> None:
    load_before = os.getloadavg()
    date = utc_timestamp()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = NUMEL - NUMEL % world
    piece = numel // world
    buckets = [torch.zeros(numel, dtype=torch.bfloat16) for _ in range(BUCKETS)]
    own = [b[rank * piece : (rank + 1) * piece] for b in buckets]

    def torch_gather() -> None:
        pairs = zip(buckets, own, strict=True)
        for work in [dist.all_gather_into_tensor(b, o, async_op=True) for b, o in pairs]:
            work.wait()

    def broadcasts() -> None:
        pairs = zip(buckets, own, strict=True)
        for work in [all_gather_into(b, o, None, async_op=True) for b, o in pairs]:
            work.wait()

    ways = {"all_gather_into_tensor": torch_gather, "broadcasts": broadcasts}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    peaks: dict[str, list[int]] = {name: [] for name in ways}
    for repeat in range(REPEATS):
        for name, launch in ways.items():
            for b in buckets:
                b.zero_()
            for o in own:
                o.fill_(rank + 1 + repeat)
            elapsed, peak = measure(launch)
            seconds[name].append(elapsed)
            peaks[name].append(peak)
            expected = torch.arange(1, world + 1).repeat_interleave(piece) + repeat
            for b in buckets:
                if not torch.equal(b, expected.to(torch.bfloat16)):
                    raise AssertionError(f"{name} gathered wrong values")
    if rank == 0:
        title = (
            f"{world} ranks, {BUCKETS} bf16 buckets of {numel * 2 / 2**20:.0f} MiB, "
            f"{REPEATS} alternations"
        )
        print_table(title, seconds, peaks)
        ratio = statistics.median(seconds["broadcasts"]) / statistics.median(
            seconds["all_gather_into_tensor"]
        )
        print(f"broadcasts / all_gather_into_tensor: {ratio:.3f}x")
        print(
            json.dumps(
                {
                    "probe": "gloo_all_gather",
                    "command": "python -m torch.distributed.run --standalone "
                    f"--nproc-per-node {world} benchmarks/probes/gloo_all_gather.py",
                    "date": date,
                    "machine": describe_host(load_before),
                    "world_size": world,
                    "bucket_bytes": numel * 2,
                    "buckets": BUCKETS,
                    "seconds": seconds,
                    "peak_rss_gain_bytes": peaks,
                    "broadcasts_over_all_gather": ratio,
                }
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
