"""SOCKET's bucket distributions of a decode batch in one launch (reference: ``Socket.batch_bucket_probs``'s PyTorch
form over ``lsh.soft_bucket_probs`` / ``lsh.hard_bucket_probs``).

``q [B, h, d]`` (h = h_kv g query heads, any float dtype), ``w [h_kv, L, P, d]`` fp32 hyperplanes ->
``[B, h_kv, L, 2**P]`` fp32: per query head, soft: u = tanh(W_l q) / sqrt(d), p_l(r) =
softmax_r(u . c_r / tau) over the hypercube's corners c_r (bit p of r set iff c_r[p] = +1); hard: the one-hot
of q's own bucket (bit p set iff (W_l q)_p > 0). The g heads of a KV head are then reduced by their mean or
max. One program per (table, KV head, row) computes the g projections, the 2**P probabilities (the softmax over
the corners factored into one logistic a plane) and the reduction in registers: the PyTorch form takes six
launches (a batched product, tanh, the corner product, softmax, the reduction and a transposed copy).
"""

from __future__ import annotations

import math

import torch

from .common import next_pow2, tl, triton

MAX_PLANES = 10  # 2**P logits per query head in registers; more planes take the PyTorch form

if triton is not None:

    @triton.jit
    def _tanh(x):
        # tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits at +-inf, no overflow to nan
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

    @triton.jit
    def _bucket_probs_kernel(Q, W, Out, g, scale, stride_qb, stride_qh, stride_wh, stride_wl,
                             stride_wp, stride_ob, stride_oh, stride_ol,
                             G_PAD: tl.constexpr, PLANES: tl.constexpr, R: tl.constexpr,
                             HEAD_DIM: tl.constexpr,
                             TABLES: tl.constexpr, HARD: tl.constexpr, MEAN: tl.constexpr):
        kh = tl.program_id(1).to(tl.int64)
        b = tl.program_id(2).to(tl.int64)
        gi = tl.arange(0, G_PAD)
        d = tl.arange(0, HEAD_DIM)
        live_g = gi < g
        q = tl.load(Q + b * stride_qb + (kh * g + gi)[:, None] * stride_qh + d[None, :],
                    mask=live_g[:, None], other=0.0).to(tl.float32)  # [G, D]
        r = tl.arange(0, R)
        for i in tl.static_range(TABLES):  # this program's tables share the query rows it loaded
            t = tl.program_id(0).to(tl.int64) * TABLES + i
            w_row = W + kh * stride_wh + t * stride_wl + d
            # softmax_r(u . c_r * scale) over the corners factors into one logistic a plane: p(r) =
            # prod_p (a_p if bit p of r else 1 - a_p), a_p = sigmoid(2 scale u_p). P products of [G, R], one a
            # plane's projection, instead of the [G, P, R] corner product, R exponentials and a normalisation.
            if HARD:
                ids = tl.zeros([G_PAD], dtype=tl.int32)
            else:
                prob = tl.full([G_PAD, R], 1.0, tl.float32)
            for bit in tl.static_range(PLANES):
                x = tl.sum(q * tl.load(w_row + bit * stride_wp)[None, :], 1)  # [G]: exact fp32 like the reference's
                if HARD:
                    ids += tl.where(x > 0, 1 << bit, 0)
                else:
                    a_b = (1.0 / (1.0 + tl.exp(-2.0 * scale * _tanh(x))))[:, None]  # [G, 1]
                    prob *= tl.where(((r[None, :] >> bit) & 1) == 1, a_b, 1.0 - a_b)
            if HARD:
                prob = (r[None, :] == ids[:, None]).to(tl.float32)  # [G, R]
            if MEAN:
                red = tl.sum(tl.where(live_g[:, None], prob, 0.0), 0) / g
            else:
                red = tl.max(tl.where(live_g[:, None], prob, 0.0), 0)
            tl.store(Out + b * stride_ob + kh * stride_oh + t * stride_ol + r, red.to(Out.dtype.element_ty))


def bucket_probs(w: torch.Tensor, q: torch.Tensor, tau: float, *, hard: bool = False, reduce: str = "mean",
                 tables_per_program: int = 1, num_warps: int = 1,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w ``[h_kv, L, P, d]``, q ``[B, h, d]`` -> group-reduced bucket distributions ``[B, h_kv, L, 2**P]``
    (see the module docstring). Fixed shapes, no host read: it runs inside a captured decode step.
    ``tables_per_program`` (dividing L) and ``num_warps`` are knobs for ``benchmarks/bench_decode_scorers.py``;
    ``out_dtype`` float16 stores the distributions rounded (computed in fp32)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    h_kv, tables, planes, d = w.shape
    b, h, dq = q.shape
    if dq != d or h % h_kv or d & (d - 1) or not 1 <= planes <= MAX_PLANES:
        raise ValueError(f"shapes do not fit: w {tuple(w.shape)}, q {tuple(q.shape)}")
    if reduce not in ("mean", "max"):
        raise ValueError(f"reduce must be mean or max, got {reduce!r}")
    w = w if w.dtype == torch.float32 and w.stride(-1) == 1 else w.float().contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    if tables_per_program < 1 or tables % tables_per_program:
        raise ValueError(f"tables_per_program must divide the {tables} tables, got {tables_per_program}")
    g = h // h_kv
    if out_dtype not in (torch.float32, torch.float16):
        raise ValueError(f"out_dtype must be float32 or float16, got {out_dtype}")
    out = torch.empty(b, h_kv, tables, 1 << planes, dtype=out_dtype, device=q.device)
    if b and tables and h_kv:
        _bucket_probs_kernel[(tables // tables_per_program, h_kv, b)](
            q, w, out, g, 1.0 / (math.sqrt(d) * float(tau)), q.stride(0), q.stride(1), w.stride(0),
            w.stride(1), w.stride(2), out.stride(0), out.stride(1), out.stride(2), G_PAD=next_pow2(g),
            PLANES=planes, R=1 << planes, HEAD_DIM=d, TABLES=tables_per_program, HARD=hard,
            MEAN=reduce == "mean", num_warps=num_warps)
    return out
