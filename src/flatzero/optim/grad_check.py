"""The gradient check (``ZeroConfig.check_gradients``): every reduction verified by projection.

Reduction is linear, so for any vector ``v`` the projection of a chunk's reduced sum equals
the sum over ranks of the projections of what each rank contributed. Each rank projects
every chunk it stages (before the collective touches it) on a seeded random ±1 vector;
after the reductions landed, each owner projects its gradient shard's part of the chunk on
the same vector; one all-reduce of a few scalars per chunk lets every rank compare the two
and raise the same error, naming the bucket, the params of the chunk, the owner and, where
the discrepancy is one rank's contribution, that rank.

[Note: the sample] Projecting every element would read every gradient once more: ~10 %
of a small-batch CPU step, against the 1 % the check may cost. Each chunk is seen as rows
of ``BLOCK`` elements (a chunk is a multiple of it) and only every ``STRIDE``-th row is
projected, starting at an offset that moves by one each window: every element is covered
once in any ``STRIDE`` consecutive windows. A chunk of at most ``STRIDE`` rows is projected
whole (a sampled row of it could be all padding or zeros, hiding a whole-chunk fault).
A fault that touches a whole chunk or every block of it (a dropped, duplicated, scaled,
delayed or skipped delivery, a garbled copy) is caught in the window it happens; a fault
confined to one block, in that window with probability ``1 / STRIDE`` and, if it
persists, within ``STRIDE`` windows.

[Note: the random vector] One ±1 vector of fp32 elements is drawn once (seed ``SEED``,
the same on every rank), as long as the largest sample plus ``SPAN``: a chunk's vector is
the slice of it at an offset hashed from the chunk's index and the window's count, so it
changes from window to window at no cost. Memory: ``1 / STRIDE`` of a staging slot.

[Note: the tolerance] The owner's sum differs from the sum of the projections only by
rounding: the reduction's (at most ``world_size`` rounding errors of ``reduce_dtype`` per
element), the fp32 shard's accumulation over the window's passes, and the fp32 dots'. With
``v`` independent of the data those errors project to about their L2 norm, bounded by
``u * S`` where ``S`` is the sum over ranks and passes of the staged samples' L2 norms; the
dots add about ``u32 * sqrt(n) * S``. The check allows ``TOL_FACTOR`` times that: a fault
that moves a chunk by ``d`` escapes with probability about ``tolerance / |d|_2``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..devices import collective_device
from .buckets import CHUNK_ALIGNMENT, BucketState, ReduceChunk

__all__ = ["GradCheck", "GradientMismatch"]

SEED = 0x5EED
"""Seed of the ±1 vector (the same on every rank)."""
BLOCK = CHUNK_ALIGNMENT
"""Elements of a sampled row (every chunk is a multiple of it)."""
STRIDE = 64
"""One row in this many is projected in a window (see the sample note)."""
SPAN = 1021
"""Offsets a chunk's vector can start at (a prime, so chunk indices spread over it)."""
TOL_FACTOR = 8.0
"""How many rounding bounds apart the two sums may be (see the tolerance note)."""


def _sampled_numel(numel: int) -> int:
    """Elements of a chunk of ``numel`` projected in a window (see the sample note)."""
    if numel <= BLOCK * STRIDE:
        return numel
    return -(-numel // (BLOCK * STRIDE)) * BLOCK


class GradientMismatch(RuntimeError):
    """A chunk's reduced gradient is not the sum of what the ranks contributed."""


def _unit(dtype: torch.dtype) -> float:
    """Unit roundoff of ``dtype``."""
    return torch.finfo(dtype).eps / 2


class GradCheck:
    """Projections of the staged chunks and of the landed shards, compared at ``verify``.

    Args:
        chunks: every reduction chunk, all buckets, in layout order.
        buckets: the reducer's buckets (``shard_view`` is where a chunk lands on its owner).
        names: each param's name, by param id (``ReduceChunk.params``).
        labels: each bucket's label in errors, by ``BucketState.index``.
        rank: this rank in ``pg``.
        world_size: ranks in ``pg``.
        pg: the reductions' process group (``None``: the default one).
        chunk_numel: the most elements of a chunk.
        reduce_dtype: dtype the chunks are summed over ranks in.
    """

    def __init__(
        self,
        chunks: Sequence[ReduceChunk],
        buckets: Sequence[BucketState],
        names: Sequence[str],
        labels: Sequence[str],
        rank: int,
        world_size: int,
        pg: dist.ProcessGroup | None,
        chunk_numel: int,
        reduce_dtype: torch.dtype,
    ) -> None:
        self.chunks = list(chunks)
        self.buckets = buckets
        self.names = names
        self.labels = labels
        self.rank = rank
        self.world_size = world_size
        self.pg = pg
        self.chunk_numel = chunk_numel
        self.reduce_dtype = reduce_dtype
        self._index = {(c.bucket, c.start): i for i, c in enumerate(self.chunks)}
        self._vector: torch.Tensor | None = None
        self._local: dict[int, list[torch.Tensor]] = {}
        """Chunk index -> [each pass's projection, sum of L2 norms] of what this rank staged."""
        self.window = 0
        """Windows ended so far (the vectors' offsets change with it)."""
        self._dirty = False
        self._table: torch.Tensor | None = None
        """This rank's table waiting for its all-reduce (``land``)."""
        self.verified = 0
        """Verifications that compared at least one chunk."""

    def _sample(self, index: int, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This window's sample of chunk ``index``'s elements ``t`` (a copy, fp32) and the
        vector it is projected on."""
        rows = t.view(-1, BLOCK)
        step = STRIDE if rows.shape[0] > STRIDE else 1  # a small chunk: every row
        sample = rows[(self.window + index) % step :: step].float().reshape(-1)  # one copy
        if self._vector is None:
            gen = torch.Generator().manual_seed(SEED)
            sampled = (self.chunk_numel // BLOCK // STRIDE + 1) * BLOCK
            most = max(sampled, min(self.chunk_numel, BLOCK * STRIDE))
            signs = torch.randint(0, 2, (most + SPAN,), generator=gen)
            self._vector = (signs * 2 - 1).to(device=t.device, dtype=torch.float32)
        offset = (self.window * 7919 + index * 104729) % SPAN
        return sample, self._vector[offset : offset + sample.numel()]

    def local(self, chunk: ReduceChunk, staged: torch.Tensor, add: bool) -> None:
        """Note ``staged``, this rank's contribution to ``chunk``, before its reduction
        starts; ``add``: it adds to the chunk's earlier reductions in the window, else it
        replaces them (stage 1 reduces the whole window's buffer at every ``finish``)."""
        index = self._index[(chunk.bucket, chunk.start)]
        x, v = self._sample(index, staged)
        proj = torch.dot(x, v)
        norm = torch.linalg.vector_norm(x)
        entry = self._local.get(index)
        if add and entry is not None:
            entry[0].append(proj)
            entry[1] = entry[1] + norm
        else:
            self._local[index] = [[proj], norm]
        self._dirty = True

    def reset(self) -> None:
        """A new accumulation window: what was staged so far counts no more (a table still
        waiting is compared first: collective)."""
        self.settle()
        self._local.clear()
        self._dirty = False
        self.window += 1

    def land(self) -> None:
        """Project what landed of every chunk reduced in the window into this rank's table
        (after the reducer's ``finish``; local work). The table waits for its all-reduce:
        ``take`` hands it to a collective the step makes anyway (the gradient norm's), else
        ``settle`` makes one; a table still waiting is settled first."""
        if not self._dirty:
            return
        self.settle()
        self._dirty = False
        n, w = len(self.chunks), self.world_size
        shard = self.buckets[0].shard_view
        passes = max(len(e[0]) for e in self._local.values())  # the same on every rank
        rows = []
        for index, (projs, norm) in self._local.items():
            chunk = self.chunks[index]
            landed = norm.new_zeros(())
            if chunk.owner == self.rank:
                view = self.buckets[chunk.bucket].shard_view
                part = view[chunk.shard_start : chunk.shard_start + chunk.numel]
                landed = torch.dot(*self._sample(index, part))
            rows.append(
                torch.stack([norm, landed, *projs, *[landed.new_zeros(())] * (passes - len(projs))])
            )
        table = torch.zeros(w, n, 2 + passes, dtype=torch.float64, device=shard.device)
        keys = torch.tensor(list(self._local), device=shard.device)
        table[self.rank].index_copy_(0, keys, torch.stack(rows).double())
        self._table = table

    def take(self) -> torch.Tensor | None:
        """The table waiting for its all-reduce (float64, on the gradient shards' device),
        or None; the caller sums it over ranks and passes the sum to ``compare``."""
        table, self._table = self._table, None
        return table

    def compare(self, summed: torch.Tensor) -> None:
        """Compare a table summed over ranks (``take``'s, all-reduced). Raises
        ``GradientMismatch``, the same on every rank."""
        self._compare(summed.cpu())
        self.verified += 1

    def settle(self) -> None:
        """All-reduce a waiting table on its own and compare it (collective)."""
        table = self.take()
        if table is None:
            return
        table = table.to(collective_device(self.pg, table.device))
        dist.all_reduce(table, group=self.pg)
        self.compare(table)

    def tolerance(self, norms: torch.Tensor, passes: int) -> torch.Tensor:
        """How far apart each chunk's two sums may be (see the tolerance note): ``norms``
        is the sum of each chunk's staged samples' L2 norms over ranks and passes."""
        numel = torch.tensor(
            [_sampled_numel(c.numel) for c in self.chunks],
            dtype=torch.float64,
        )
        rounding = self.world_size * _unit(self.reduce_dtype) + _unit(torch.float32) * (
            passes + numel.sqrt()
        )
        return TOL_FACTOR * rounding * norms + torch.finfo(torch.float32).tiny

    def _compare(self, table: torch.Tensor) -> None:
        """Raise for the first chunk whose two sums differ (the same on every rank).

        ``table[rank, chunk]``: (sum of L2 norms, landed projection, each pass's
        projection). A chunk whose sums are not finite is skipped (an overflow: the loss
        scaler skips the step)."""
        per_pass = table[:, :, 2:]
        want, got = per_pass.sum((0, 2)), table[:, :, 1].sum(0)
        tol = self.tolerance(table[:, :, 0].sum(0), per_pass.shape[2])
        bad = ((want - got).abs() > tol) & want.isfinite() & got.isfinite()
        if bool(bad.any()):
            index = int(bad.nonzero()[0])
            raise GradientMismatch(
                self._message(
                    index,
                    per_pass[:, index],
                    float(want[index]),
                    float(got[index]),
                    float(tol[index]),
                )
            )

    def _message(
        self, index: int, per_pass: torch.Tensor, want: float, got: float, tol: float
    ) -> str:
        chunk = self.chunks[index]
        params = ", ".join(
            f"{self.names[pid]}[{first}:{first + numel}]" for pid, first, _, numel in chunk.params
        )
        diff = want - got
        culprits = {
            r
            for r in range(self.world_size)
            for p in range(per_pass.shape[1])
            if abs(diff - float(per_pass[r, p])) <= tol
            or abs(diff - float(per_pass[r].sum())) <= tol
        }
        blame = ""
        if len(culprits) == 1 and self.world_size > 1:
            (r,) = culprits
            blame = (
                f"; the difference is rank {r}'s contribution: rank {r}'s gradient did not arrive"
            )
        contrib = [round(float(c), 9) for c in per_pass.sum(1)]
        return (
            f"flatzero gradient check: the reduced gradient of {self.labels[chunk.bucket]} "
            f"elements [{chunk.start}:{chunk.end}] (params {params or 'none: padding'}), "
            f"held by rank {chunk.owner}, is not the sum of what the ranks contributed: "
            f"projection {got:.9g} landed, {want:.9g} sent (rank contributions {contrib}, "
            f"tolerance {tol:.3g}){blame}. A reduction was dropped, duplicated, scaled or "
            f"corrupted: a communication fault, or a gradient changed after it was staged"
        )
