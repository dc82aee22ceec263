"""Causal prefill attention on CPUs as oneDNN GEMMs over blocks of query rows.

PyTorch's fused CPU flash attention runs at about a third of the rate oneDNN's GEMM reaches on the same
cores (its inner products are small, head-dim-deep tiles with an online softmax between them). Here each
block of ``BLOCK`` query positions of a KV group's query heads takes one GEMM against every key it sees
(scores [g * block, keys], a few MB, held in cache), one pass of a small C kernel that takes the causal
softmax's max and writes exp(score - max) in place with the row sums (``native``; PyTorch's masked softmax
where no compiler is found), and one GEMM with the values, whose rows are divided by the sums: about 1.4x
PyTorch's flash attention per core at 1024 x 4096, the same products in fp32. Only keys at or before a
block's last position are read, so a whole causal prompt costs about half of the square.

oneDNN takes K of a group as its weight operand as it lies ([n_k, d] rows) and V as the transposed view of
one (``onednn.matmul``): neither is copied.
"""

from __future__ import annotations

import ctypes
import math

import torch

from . import native, onednn

BLOCK = 128  # query positions a GEMM takes: scores of 3 heads x 128 rows x 4K keys are 6 MB (128 measured
#             fastest per core against 64, 170 and 256 at 512-4096 keys)
_DTYPES = (torch.float32,)  # lower precisions keep the fused flash attention, whose softmax runs in fp32


_SOURCE = native.VEC_EXP + r"""
#include <float.h>
#include <math.h>
#include <stdint.h>

/* s [rows, cols]: row i keeps its first min(cols, base + i % block + 1) scores (the query at offset i % block
   of its block sees the keys up to its own), written as exp(score - the row's max); the rest are zeroed.
   sums[i]: the row's sum, by which the caller divides the row's output, so the scores are read twice, not
   three times as by a softmax that normalises them. */
void softmax_causal_rows(float *s, int64_t rows, int64_t cols, int64_t base, int64_t block, float *sums,
                         int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < rows; i++) {
        float *r = s + i * cols;
        int64_t n = base + i % block + 1;
        if (n > cols) n = cols;
        float mx = -FLT_MAX, sum = 0.0f;
        #pragma omp simd reduction(max:mx)
        for (int64_t x = 0; x < n; x++) mx = r[x] > mx ? r[x] : mx;
        #pragma omp simd reduction(+:sum)
        for (int64_t x = 0; x < n; x++) { r[x] = rs_expf(r[x] - mx); sum += r[x]; }
        for (int64_t x = n; x < cols; x++) r[x] = 0.0f;
        sums[i] = sum;
    }
}
"""
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {"softmax_causal_rows": ([_ptr, _i64, _i64, _i64, _i64, _ptr, ctypes.c_int], None)}


def _softmax_rows(s: torch.Tensor, base: int, block: int) -> torch.Tensor | None:
    """The C kernel's unnormalised causal softmax of s [rows, cols] in place (see its comment); its row sums,
    or None where the kernel cannot be built (the caller masks and normalises in PyTorch)."""
    lib = native.load("cpu_prefill", _SOURCE, _SIGNATURES)
    if lib is None:
        return None
    sums = torch.empty(s.shape[0], dtype=torch.float32)
    lib.softmax_causal_rows(s.data_ptr(), s.shape[0], s.shape[1], base, block, sums.data_ptr(),
                            torch.get_num_threads())
    return sums


def _gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [m, k] @ b[n, k]^T by oneDNN (PyTorch's CPU matmul takes MKL's sgemm, which is slower here)."""
    return onednn.linear(a, b)


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``causal_attention_cpu`` serves these tensors: CPU, fp32, oneDNN present, no autograd."""
    return (q.device.type == "cpu" and q.dtype in _DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
            and onednn.AVAILABLE
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)))


def causal_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float | None = None) -> torch.Tensor:
    """q [n_q, h, d], the last n_q of the n_k positions in k, v [h_kv, n_k, d] (any strides): causal
    attention, out [n_q, h, d]. Every query row sees at least its own key, so no row is empty."""
    n_q, h, d = q.shape
    h_kv, n_k = k.shape[0], k.shape[1]
    if n_q > n_k:
        raise ValueError(f"{n_q} queries over {n_k} keys: the queries are the last of the keys' positions")
    g, start = h // h_kv, n_k - n_q
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    block = min(BLOCK, n_q)
    # [h_kv, blocks, g * block, d]: each block's rows are its group's query heads one after the other.
    n_blocks = -(-n_q // block)
    qs = (q * scale).view(n_q, h_kv, g, d)
    if n_blocks * block != n_q:
        qs = torch.nn.functional.pad(qs, (0, 0, 0, 0, 0, 0, 0, n_blocks * block - n_q))
    qs = qs.view(n_blocks, block, h_kv, g, d).permute(2, 0, 3, 1, 4).contiguous()
    upper = torch.ones(block, block, dtype=torch.bool, device=q.device).triu_(1)
    out = torch.empty(h_kv, n_blocks, g, block, d, dtype=q.dtype, device=q.device)
    for j in range(h_kv):
        kj = k[j] if k[j].is_contiguous() else k[j].contiguous()
        vj = v[j] if v[j].is_contiguous() else v[j].contiguous()
        for b in range(n_blocks):
            t0, t1 = b * block, min((b + 1) * block, n_q)
            end = start + t1
            s = _gemm(qs[j, b].view(g * block, d), kj[:end])
            sums = _softmax_rows(s, start + t0, block)
            if sums is None:
                s = s.view(g, block, end)
                s[:, :, start + t0:].masked_fill_(upper[:, : t1 - t0], -math.inf)
                s = torch.softmax(s, dim=-1).view(g * block, end)
            o = onednn.matmul(s, vj[:end])
            out[j, b] = (o if sums is None else o / sums[:, None]).view(g, block, d)
    # [h_kv, blocks, g, block, d] -> [n_q, h, d]
    return out.permute(1, 3, 0, 2, 4).reshape(n_blocks * block, h, d)[:n_q]
