"""oneDNN's GEMM on CPUs: the model's projections and the CPU attention paths' products.

PyTorch's CPU ``linear`` and ``matmul`` take MKL's sgemm, which on AMD processors runs without AVX-512 at
less than half the rate (a prefill chunk's projections 2.1x, a decode step's 1.3x slower on the 2-core
machine); oneDNN picks the processor's widest kernels. Same products, fp32 accumulation either way.
"""

from __future__ import annotations

import torch

AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
# bf16 only where the processor has oneDNN's bf16 kernels (AVX-512 BF16 or AMX): on AVX2 alone oneDNN cannot
# create a bf16 inner product at all, and PyTorch's linear (which converts) serves instead.
DTYPES = (torch.float32, torch.bfloat16) if AVAILABLE and torch.ops.mkldnn._is_mkldnn_bf16_supported() \
    else (torch.float32,)


def serves(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether oneDNN takes ``x @ w.T``: CPU tensors of one of its dtypes, dense rows, no autograd recording."""
    return (AVAILABLE and x.device.type == "cpu" and x.dtype in DTYPES and w.dtype == x.dtype and w.dim() == 2
            and w.is_contiguous() and x.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)``: oneDNN's GEMM where it ``serves`` the tensors, PyTorch's linear otherwise
    (inference only: with autograd recording, PyTorch's)."""
    if serves(x, w):
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return torch.nn.functional.linear(x, w, b)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for a [m, k] and a dense b [k, n]: oneDNN takes b as the transposed view of its [n, k] weight
    operand, with no copy (a decode step's probabilities times a page run's values, 2.3x MKL's batched tiles
    at 4K keys), and ``torch.mm`` where oneDNN does not serve the tensors."""
    if serves(a, b) and a.shape[1] == b.shape[0]:
        return torch.ops.mkldnn._linear_pointwise(a, b.t(), None, "none", [], "")
    return torch.mm(a, b)
