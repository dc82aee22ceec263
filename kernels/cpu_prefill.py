"""Causal prefill attention on CPUs as oneDNN GEMMs over blocks of query rows.

PyTorch's fused CPU flash attention runs at about a third of the rate oneDNN's GEMM reaches on the same
cores (its inner products are small, head-dim-deep tiles with an online softmax between them). Here each
block of ``BLOCK`` query positions of a KV group's query heads takes one GEMM against every key it sees
(scores [g * block, keys], a few MB, held in cache), one softmax, and one GEMM with the values: about 1.7x
faster per core at 512-4096 keys, the same products in fp32. Only keys at or before a block's last position
are read, so a whole causal prompt costs about half of the square; the diagonal's upper half is masked.

oneDNN's GEMM wants both operands dense in their last two dims: K of a group is already [n_k, d]; V is read
transposed once per call ([d, n_k]), and a block that stops short of the last key copies its part of it.
"""

from __future__ import annotations

import math

import torch

from . import onednn

BLOCK = 128  # query positions a GEMM takes: scores of 3 heads x 128 rows x 4K keys are 6 MB (128 measured
#             fastest per core against 64, 170 and 256 at 512-4096 keys)
_DTYPES = (torch.float32,)  # lower precisions keep the fused flash attention, whose softmax runs in fp32


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
        vt = v[j].t().contiguous()  # [d, n_k]
        for b in range(n_blocks):
            t0, t1 = b * block, min((b + 1) * block, n_q)
            end = start + t1
            s = _gemm(qs[j, b].view(g * block, d), kj[:end]).view(g, block, end)
            s[:, :, start + t0:].masked_fill_(upper[:, : t1 - t0], -math.inf)
            s = torch.softmax(s, dim=-1)
            out[j, b] = _gemm(s.view(g * block, end), vt if end == n_k else vt[:, :end].contiguous()).view(g, block, d)
    # [h_kv, blocks, g, block, d] -> [n_q, h, d]
    return out.permute(1, 3, 0, 2, 4).reshape(n_blocks * block, h, d)[:n_q]
