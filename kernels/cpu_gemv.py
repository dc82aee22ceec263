"""The CPU's products of a few rows by a weight (a decode step's projections and LM head): a C kernel that
streams the weight once.

With a few rows a projection is a read of its weight and little more, so its time is the memory's rate.
oneDNN's GEMM takes these shapes well under it (on an AVX2-only 2-core machine, across a decode step's 425 MB
of projections: 8.8 GB/s at one row, 4.3 at two to eight, where a plain streaming read reaches 14.1). Here each
thread reads its contiguous share of the weight's rows once, each row against every input row held in L1: 12.6
GB/s at one row, 11.7 at two, 9.2 at four, 7.4 at eight (``benchmarks/bench_cpu_gemv.py``).
Each output is one row's dot product in a fixed order, so it does not depend on how many rows share the call.
"""

from __future__ import annotations

import ctypes

import torch

from . import native

MAX_ROWS = 8  # with this limit raised, 16 rows ran at 4.7 GB/s against oneDNN's 4.8, and 32 slower

_SOURCE = native.VEC8 + r"""
#include <stdint.h>

/* y[m, n] = b[n] + sum_k x[m, k] w[n, k] for m < M: the threads split w's rows, each row read once (its
   dot products with every x row, which stay in L1), 16 floats a step in two vector sums, then the tail. */
void gemv_rows(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t N, int64_t K,
               int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        const float *wr = w + n * K;
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            v8f a0 = {0}, a1 = {0};
            int64_t k = 0;
            for (; k + 16 <= K; k += 16) {
                a0 += ld8(wr + k) * ld8(xm + k);
                a1 += ld8(wr + k + 8) * ld8(xm + k + 8);
            }
            float s = hsum8(a0 + a1);
            for (; k < K; k++) s += wr[k] * xm[k];
            y[m * N + n] = b ? s + b[n] : s;
        }
    }
}
"""
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {"gemv_rows": ([_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_int], None)}


def _lib() -> ctypes.CDLL | None:
    return native.load("cpu_gemv", _SOURCE, _SIGNATURES)


def serves(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> bool:
    """Whether ``linear`` takes ``x @ w.T + b``: fp32 CPU tensors, at most ``MAX_ROWS`` dense rows (any leading
    shape), a dense [n, k] weight, no autograd recording, and a compiler here."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32 and w.dim() == 2
            and x.shape[-1] == w.shape[1] and x.numel() <= MAX_ROWS * w.shape[1] and x.numel() > 0
            and x.is_contiguous() and w.is_contiguous()
            and (b is None or (b.dtype == torch.float32 and b.is_contiguous() and b.shape == (w.shape[0],)))
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad
                                                 or (b is not None and b.requires_grad)))
            and _lib() is not None)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)`` for the tensors ``serves`` takes (the caller checks)."""
    k, n = w.shape[1], w.shape[0]
    rows = x.numel() // k
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    _lib().gemv_rows(x.data_ptr(), w.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(), rows, n, k,
                     torch.get_num_threads())
    return y
