"""Deterministic, device-independent initialization of a model built on the meta device."""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from ._params import ParameterSlots

__all__ = ["CHUNK_NUMEL", "INIT_STD", "materialize"]

INIT_STD = 0.02
"""Standard deviation of the normal init of matrices (HF ``initializer_range``)."""

CHUNK_NUMEL = 1 << 20
"""Elements drawn from one random generator; chunks are filled in parallel."""


def _chunk_seed(seed: int, name: str, chunk: int) -> int:
    """A 63-bit seed that depends only on ``(seed, name, chunk)``, stable across runs."""
    digest = hashlib.blake2b(f"{seed}\0{name}\0{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


_scratch = threading.local()


def _fill_normal(flat: torch.Tensor, name: str, seed: int, chunk: int) -> None:
    """Fill chunk ``chunk`` of ``flat`` with N(0, INIT_STD²) drawn in float32, then cast."""
    generator = torch.Generator().manual_seed(_chunk_seed(seed, name, chunk))
    part = flat[chunk * CHUNK_NUMEL : (chunk + 1) * CHUNK_NUMEL]
    if part.dtype == torch.float32:
        part.normal_(0.0, INIT_STD, generator=generator)
        return
    # A float32 scratch chunk per thread, reused: a fresh 4 MiB allocation per chunk
    # would page-fault on every chunk.
    if getattr(_scratch, "buffer", None) is None:
        _scratch.buffer = torch.empty(CHUNK_NUMEL)
    values = _scratch.buffer[: part.numel()]
    part.copy_(values.normal_(0.0, INIT_STD, generator=generator))


def _init_host_tensor(
    name: str, shape: torch.Size, dtype: torch.dtype, seed: int, pool: ThreadPoolExecutor
) -> torch.Tensor:
    host = torch.empty(shape, dtype=dtype)
    if host.dim() < 2:
        host.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        return host
    flat = host.view(-1)
    chunks = range((flat.numel() + CHUNK_NUMEL - 1) // CHUNK_NUMEL)
    # list() propagates any exception raised in a worker.
    list(pool.map(lambda chunk: _fill_normal(flat, name, seed, chunk), chunks))
    return host


def materialize(
    model: nn.Module,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
    *,
    threads: int | None = None,
) -> nn.Module:
    """Give every parameter of ``model`` real storage on ``device``, deterministically filled.

    Matrices and 3-D expert tensors (``dim >= 2``) get N(0, ``INIT_STD``²); 1-D parameters
    whose name ends in ``norm.weight`` get ones, other 1-D parameters zeros. A parameter's
    values depend only on ``seed``, its name (the first name under which
    ``named_parameters`` lists it) and its shape: not on ``device``, on which or how many
    parameters were materialized before, or on the thread count. Values are drawn in
    float32 on the CPU, in chunks of ``CHUNK_NUMEL`` elements each from its own
    ``torch.Generator`` seeded from ``(seed, name, chunk index)``, cast to the target dtype
    and copied to ``device``; so a bfloat16 model is the rounding of the float32 one.

    Works on a model on the meta device or already materialized (it is re-initialized).
    Every parameter is replaced by a new ``Parameter`` (tied parameters stay one object),
    so build optimizers after this call. The zoo's models have no buffers.

    Args:
        model: the model; modified in place and returned.
        device: where the parameters go; not ``"meta"``.
        dtype: floating dtype of every parameter; ``None`` keeps each parameter's dtype.
        seed: non-negative int selecting the init.
        threads: host threads drawing random chunks in parallel; ``None`` means
            ``torch.get_num_threads()``. Does not change the values.

    Returns:
        ``model``.
    """
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError("materialize(device='meta') allocates nothing; pass 'cpu' or 'cuda'")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"materialize seed must be a non-negative int, got {seed!r}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"materialize dtype must be a floating dtype, got {dtype}")
    if threads is None:
        threads = torch.get_num_threads()
    elif not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"materialize threads must be a positive int or None, got {threads!r}")
    slots = ParameterSlots(model)
    with ThreadPoolExecutor(threads) as pool, torch.no_grad():
        for name, param in list(model.named_parameters()):
            target = dtype or param.dtype
            if not target.is_floating_point:
                raise ValueError(
                    f"materialize fills floating parameters only; {name} is {target}; "
                    "pass a floating dtype"
                )
            host = _init_host_tensor(name, param.shape, target, seed, pool)
            slots.replace(param, host.to(device))
    return model
