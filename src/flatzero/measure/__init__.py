"""Measuring, below both ``flatzero plan`` and ``flatzero bench``.

What a product feature needs from measurement lives here, not in the benchmark harness:
``plan`` calibrates its time model with these rates and predicts DeepSpeed's paths with
these algorithms, and the harness (``benchmarks/flatzero_bench``) reports against them.
Nothing here imports the harness.

- ``limits``: hardware limits (memcpy, first touch of new memory, device copy, pinned
  upload), each measured for the bytes at hand.
- ``baselines``: DeepSpeed ZeRO-1/2's flatten at init (``torch.cat`` of a whole group and
  the legacy CPU path), re-implemented to be timed, and its padding arithmetic.
- ``settle``: the ``--settle-s`` option (wait before writing new memory).
"""
