"""``flatzero_bench.offload.offload_trial`` with the all-gathers made synchronous.

With ``GATHER_MODE=sync`` every all-gather flatzero starts (``comm._all_gather_single``)
completes before the call returns, so none is in flight beside another; with
``GATHER_MODE=async`` (the default) nothing is patched. Comparing the two shows what the
all-gathers in flight hold in a step's peak host memory on gloo:

    export PYTHONPATH=benchmarks  # the harness, flatzero_bench
    for m in sync async; do GATHER_MODE=$m OMP_NUM_THREADS=1 python -m torch.distributed.run \\
        --standalone --nproc-per-node 2 benchmarks/probes/sync_gather_trial.py \\
        --door flatzero --model llama-0.4b --steps 3; done

Each prints ``offload_trial``'s result line (``peak_rss_phase_bytes`` per step phase).
"""

import os

import flatzero.comm as comm
from flatzero_bench.offload import offload_trial


def main() -> None:
    if os.environ.get("GATHER_MODE", "async") == "sync":
        gather = comm._all_gather_single

        def synchronous(output, shard, group=None, async_op=False):
            gather(output, shard, group=group, async_op=False)

        comm._all_gather_single = synchronous
    offload_trial.main()


if __name__ == "__main__":
    main()
