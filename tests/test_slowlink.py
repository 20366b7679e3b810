"""The emulated slow link (``flatzero.testing.slowlink``) charges both libraries alike:
keyword-argument calls (DeepSpeed's style) are slowed by their largest buffer, and the
collectives DeepSpeed's communication backend cached at its start are wrapped too."""

from __future__ import annotations

import sys
import time
import types

import torch
import torch.distributed as dist

from flatzero.testing.slowlink import SlowLink, slow_link


def test_a_keyword_call_is_charged_its_largest_buffer():
    link = SlowLink(bytes_per_s=1e5)
    seen = []
    slowed = link.wrap(lambda **kw: seen.append(kw), "all_gather_into_tensor")
    out, shard = torch.zeros(2500), torch.zeros(1250)  # 10 kB gathered, 5 kB sent
    t0 = time.perf_counter()
    slowed(output_tensor=out, input_tensor=shard)
    assert time.perf_counter() - t0 >= 0.095  # 10 kB through 100 kB/s
    assert link.bytes_by_name == {"all_gather_into_tensor": 10_000}
    assert seen and seen[0]["output_tensor"] is out
    listed = link.wrap(lambda *a, **kw: None, "all_gather")
    listed([torch.zeros(10), torch.zeros(10)], torch.zeros(10))  # a list counts as its sum
    assert link.bytes_by_name["all_gather"] == 80


def test_deepspeeds_cached_collectives_go_through_the_link(monkeypatch):
    backend = types.SimpleNamespace(
        all_gather_function=dist.all_gather_into_tensor,
        reduce_scatter_function=dist.reduce_scatter_tensor,
    )
    fake = types.ModuleType("deepspeed.comm.comm")
    fake.cdb = backend
    monkeypatch.setitem(sys.modules, "deepspeed.comm.comm", fake)
    originals = (backend.all_gather_function, backend.reduce_scatter_function, dist.reduce)
    with slow_link(1e6):
        assert backend.all_gather_function is not originals[0]
        assert backend.reduce_scatter_function is not originals[1]
        assert dist.reduce is not originals[2]
        assert backend.all_gather_function.__wrapped__ is originals[0]
    assert (backend.all_gather_function, backend.reduce_scatter_function) == originals[:2]
    assert dist.reduce is originals[2]
