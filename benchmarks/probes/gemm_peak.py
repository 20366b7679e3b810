"""Peak host memory of one linear layer's backward on this CPU, bf16 and fp32.

The weight has the shape of llama-0.4b's ``lm_head`` (128256 x 1024), the input 2 tokens:
the high-water mark gained over ``backward()`` (the mark reset just before) against the
weight's bytes. 2 bytes per element in bf16 means the gradient alone, no fp32 temporary.

    python benchmarks/probes/gemm_peak.py
"""

import torch

from flatzero.procmem import peak_rss_bytes, reset_peak_rss, rss_bytes, trim_host_memory

OUT_FEATURES, IN_FEATURES = 128256, 1024


def backward_peak(dtype: torch.dtype) -> tuple[int, int]:
    """(the weight's bytes, the high-water mark gained by its second backward), bytes."""
    weight = torch.nn.Parameter(torch.randn(OUT_FEATURES, IN_FEATURES, dtype=dtype))
    x = torch.randn(1, 2, IN_FEATURES, dtype=dtype, requires_grad=True)
    gained = 0
    for _ in range(2):  # the second pass: the allocator's first-time costs are behind
        y = torch.nn.functional.linear(x, weight).float().sum()
        trim_host_memory()
        reset_peak_rss()
        before = rss_bytes()
        y.backward()
        gained = peak_rss_bytes() - before
        weight.grad = None
    return weight.numel() * weight.element_size(), gained


def main() -> None:
    torch.set_num_threads(1)
    for dtype in (torch.bfloat16, torch.float32):
        weight_bytes, gained = backward_peak(dtype)
        elements = OUT_FEATURES * IN_FEATURES
        print(
            f"{dtype}: weight {weight_bytes} bytes, backward peak gained {gained} bytes = "
            f"{gained / elements:.2f} bytes per element"
        )


if __name__ == "__main__":
    main()
