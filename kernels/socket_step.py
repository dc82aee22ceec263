"""SOCKET's batched decode step in few launches: the query-side bucket distributions of the batch in one
(``group_bucket_probs``) and each row's budget in another (``step_budgets``); the collision scores and the list
are ``paged_collision``'s and ``row_select``'s. The PyTorch forms, the CPU path and the oracles, are
``methods.socket_batched``'s ``bucket_probs_torch`` and ``budget_rows``.

Bucket distributions (the PyTorch form: ``lsh.soft_bucket_probs`` / ``hard_bucket_probs`` of every query head,
then the mean or max over each KV head's group):

``w [h_kv, L, P, d]`` fp32 hyperplanes, ``q [B, h, d]`` (h = g * h_kv, any float dtype) -> fp32 ``[B, h_kv, L,
R = 2**P]``: soft, u = tanh(W_l q) / sqrt(d) and p_l(r) = softmax_r(u . c_r / tau) (c_r the sign pattern of bucket
id r, ``lsh.corners``); hard, the one-hot of q's bucket id (bit p set iff (W_l q)_p > 0); then the mean (or max)
over the g query heads of the KV head. One program per (table, KV head, row) holds the group's g queries, projects
them on the table's P planes, builds the g x R logits by summing +-u_p plane by plane (the corner with u's signs
is then the largest logit exactly, so the softmax's max needs no pass) and writes the group-reduced row, in tiles
of R where the g x R tile would not fit (two passes: the softmax's sum, then the row).

Precision against the PyTorch form: hard rows are the same bit for bit (the counts are exact; the mean is taken as
that device's PyTorch takes it, sum / g on CPUs, sum * (N_out / numel) on CUDA) unless a projection lies within
fp32 rounding of 0 (another summation order may give it the other sign). Soft rows equal it to fp32 rounding:
projections, logits, the softmax's sum and the group mean are sums in another order; on GPUs tanh and exp are
libdevice's (CUDA's, as PyTorch's), in the interpreter (which has no tanh) tanh comes from an fp64 exp.

Budgets (``Socket.budget`` per row, the rule ``budget_rows`` runs in some thirty [B, 1] PyTorch ops): from the
lengths [B], each row's sink and local counts [B] and its scored count k repeated for its KV heads [B * h_kv]
(``select_list``'s kk), in one program, exactly ``budget_rows``'s: the density's fp32 product rounded half to
even (``common.row_budget_units``), the forced share's fp64 product floored, the same integer steps.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .common import interpreting, next_pow2, row_budget_units, tl, triton

_TILE = 4096  # most g x R logits a program holds at once (fp32), so 2**15 buckets still fit its registers

if triton is not None:
    from triton.language.extra import libdevice

    @triton.jit
    def _tanh(x, LIBDEVICE: tl.constexpr):
        if LIBDEVICE:
            y = libdevice.tanh(x)
        else:
            # Triton's interpreter has no tanh: (1 - e) / (1 + e), e = exp(-2|x|), in fp64 (relative error ~1e-13,
            # the Taylor x - x^3 / 3 below 1e-3 where 1 - e would cancel), rounded once to fp32.
            a = tl.abs(x).to(tl.float64)
            e = tl.exp(-2.0 * a)
            t = tl.where(a < 1e-3, a - a * a * a / 3.0, (1.0 - e) / (1.0 + e))
            y = tl.where(x < 0, -t, t).to(tl.float32)
        return y

    @triton.jit
    def _exp(x, LIBDEVICE: tl.constexpr):
        if LIBDEVICE:
            y = libdevice.exp(x)  # expf, as PyTorch's on CUDA (tl.exp is ex2.approx of x * log2(e))
        else:
            y = tl.exp(x)
        return y

    @triton.jit
    def _logits(u, r, tau, PLANES: tl.constexpr, P_PAD: tl.constexpr, RECIP: tl.constexpr):
        """The g x len(r) logits u . c_r / tau of u [G_PAD, P_PAD], summed plane by plane from 0."""
        pc = tl.arange(0, P_PAD)
        x = tl.zeros([u.shape[0], r.shape[0]], dtype=tl.float32)
        for p in tl.static_range(PLANES):
            up = tl.sum(tl.where(pc[None, :] == p, u, 0.0), 1)  # u[:, p] (exact: the rest are zeros)
            x += tl.where(((r >> p) & 1)[None, :] != 0, up[:, None], -up[:, None])
        return x * tau if RECIP else tl.math.div_rn(x, tau)

    @triton.jit
    def _group(prob, ok_g, g_f, mean_factor, MAX: tl.constexpr, RECIP: tl.constexpr):
        """The mean (sum / g, or sum * mean_factor as PyTorch on CUDA) or the max over the group's rows."""
        prob = tl.where(ok_g[:, None], prob, 0.0)  # probabilities are >= 0: a zero row leaves the max alone
        if MAX:
            return tl.max(prob, 0)
        if RECIP:
            return tl.sum(prob, 0) * mean_factor
        return tl.math.div_rn(tl.sum(prob, 0), g_f)

    @triton.jit
    def _group_probs_kernel(Q, W, Out, g, g_f, tau, scale, mean_factor,
                            stride_qb, stride_qh, stride_wh, stride_wl, stride_wp, stride_ob, stride_oh, stride_ol,
                            D: tl.constexpr, D_PAD: tl.constexpr, G_PAD: tl.constexpr, PLANES: tl.constexpr,
                            P_PAD: tl.constexpr, R_BLOCK: tl.constexpr, HARD: tl.constexpr, MAX: tl.constexpr,
                            RECIP: tl.constexpr, LIBDEVICE: tl.constexpr):
        t = tl.program_id(0)  # table
        h = tl.program_id(1)  # KV head
        b = tl.program_id(2).to(tl.int64)  # row
        R: tl.constexpr = 1 << PLANES
        gi = tl.arange(0, G_PAD)
        ok_g = gi < g
        d = tl.arange(0, D_PAD)
        q = tl.load(Q + b * stride_qb + (h * g + gi).to(tl.int64)[:, None] * stride_qh + d[None, :],
                    mask=ok_g[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
        w_row = W + h.to(tl.int64) * stride_wh + t.to(tl.int64) * stride_wl
        out_row = Out + b * stride_ob + h.to(tl.int64) * stride_oh + t.to(tl.int64) * stride_ol
        pc = tl.arange(0, P_PAD)
        u = tl.zeros([G_PAD, P_PAD], dtype=tl.float32)
        ids = tl.zeros([G_PAD], dtype=tl.int32)
        top = tl.zeros([G_PAD], dtype=tl.float32)  # sum_p |u_p| in the logits' order: the largest logit's sum
        for p in tl.static_range(PLANES):
            proj = tl.sum(q * tl.load(w_row + p * stride_wp + d, mask=d < D, other=0.0)[None, :], 1)  # [G_PAD]
            if HARD:
                ids += tl.where(proj > 0, 1 << p, 0)
            else:
                up = _tanh(proj, LIBDEVICE) * scale if RECIP else tl.math.div_rn(_tanh(proj, LIBDEVICE), scale)
                u = tl.where(pc[None, :] == p, up[:, None], u)
                top += tl.abs(up)
        if HARD:
            for r0 in range(0, R, R_BLOCK):
                r = r0 + tl.arange(0, R_BLOCK)
                count = tl.sum(((ids[:, None] == r[None, :]) & ok_g[:, None]).to(tl.int32), 0)
                if MAX:
                    row = (count > 0).to(tl.float32)
                elif RECIP:
                    row = count.to(tl.float32) * mean_factor
                else:
                    row = tl.math.div_rn(count.to(tl.float32), g_f)
                tl.store(out_row + r, row)
        else:
            # The corner with u's signs adds every |u_p|: fl-sums are monotone, so its logit is the exact max.
            m = (top * tau if RECIP else tl.math.div_rn(top, tau))[:, None]
            if R_BLOCK == R:
                r = tl.arange(0, R)
                e = _exp(_logits(u, r, tau, PLANES, P_PAD, RECIP) - m, LIBDEVICE)
                prob = tl.math.div_rn(e, tl.sum(e, 1)[:, None])
                tl.store(out_row + r, _group(prob, ok_g, g_f, mean_factor, MAX, RECIP))
            else:
                total = tl.zeros([G_PAD], dtype=tl.float32)
                for r0 in range(0, R, R_BLOCK):
                    r = r0 + tl.arange(0, R_BLOCK)
                    total += tl.sum(_exp(_logits(u, r, tau, PLANES, P_PAD, RECIP) - m, LIBDEVICE), 1)
                for r0 in range(0, R, R_BLOCK):
                    r = r0 + tl.arange(0, R_BLOCK)
                    e = _exp(_logits(u, r, tau, PLANES, P_PAD, RECIP) - m, LIBDEVICE)
                    tl.store(out_row + r, _group(tl.math.div_rn(e, total[:, None]), ok_g, g_f, mean_factor, MAX, RECIP))

    @triton.jit
    def _budget_kernel(SEQ, Sink, Local, KK, rows, heads, density, share_hi, share_mid, share_lo, top_k,
                       SINK_TOKENS: tl.constexpr, LOCAL_TOKENS: tl.constexpr, FORCED_DIV: tl.constexpr,
                       DENSITY: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        ok = i < rows
        n = tl.load(SEQ + i, mask=ok, other=1).to(tl.int64)
        sink = tl.minimum(n, SINK_TOKENS)
        local = tl.minimum(n - sink, LOCAL_TOKENS)
        if DENSITY:
            # row_budget multiplies the fp32 length (n.float()): rounded to fp32 first, as there
            b = row_budget_units(n.to(tl.float32), density).to(tl.int64)
            # the forced share in fp64, rebuilt exactly from its three fp32 parts (a float argument is fp32)
            share = (tl.cast(share_hi, tl.float64) + tl.cast(share_mid, tl.float64)) + tl.cast(share_lo, tl.float64)
            cap = tl.floor(b.to(tl.float64) * share).to(tl.int64)
            over = cap < sink + local
            shrunk = tl.minimum(sink, cap * SINK_TOKENS // FORCED_DIV)
            sink = tl.where(over, shrunk, sink)
            local = tl.where(over, tl.minimum(tl.minimum(n - sink, LOCAL_TOKENS), cap - sink), local)
            k = b - sink - local
        else:
            k = tl.zeros([BLOCK], dtype=tl.int64) + top_k
        top = tl.minimum(tl.maximum(k, 0), n - sink - local)
        tl.store(Sink + i, sink.to(tl.int32), mask=ok)
        tl.store(Local + i, local.to(tl.int32), mask=ok)
        for hh in range(heads):
            tl.store(KK + i * heads + hh, top.to(tl.int32), mask=ok)


def _f32(x: float) -> float:
    return float(np.float32(x))


def group_bucket_probs(w: torch.Tensor, q: torch.Tensor, tau: float, hard: bool, reduce_max: bool,
                       num_warps: int = 4, tile: int = _TILE) -> torch.Tensor:
    """w [h_kv, L, P, d] (fp32), q [B, h, d] -> fp32 [B, h_kv, L, 2**P]: each KV head's group-reduced (``reduce_max``:
    max, else mean) soft (``tau``) or ``hard`` bucket distributions, one launch. ``num_warps`` and ``tile`` (the
    most g x R logits held at once) are knobs for benchmarks and tests."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    h_kv, tables, planes, d = w.shape
    b, h, dq = q.shape
    if dq != d or h % h_kv:
        raise ValueError(f"shapes do not fit: w {tuple(w.shape)}, q {tuple(q.shape)}")
    g, r = h // h_kv, 1 << planes
    w = w if w.dtype == torch.float32 and w.stride(-1) == 1 else w.float().contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(b, h_kv, tables, r, dtype=torch.float32, device=q.device)
    if not out.numel():
        return out
    g_pad = max(2, next_pow2(g))
    # PyTorch on CUDA divides by a scalar as a multiply by its fp32 reciprocal and takes a mean as the sum times
    # fp32(outputs) / numel; on the CPU it divides. The kernel does as the device's PyTorch does.
    recip = q.is_cuda
    if recip:
        tau_arg = _f32(np.float32(1.0) / np.float32(tau))
        scale = _f32(np.float32(1.0) / np.float32(math.sqrt(d)))
        n_out = b * h_kv * tables * r
        mean_factor = _f32(np.float32(n_out) / np.float32(n_out * g))
    else:
        tau_arg, scale, mean_factor = _f32(tau), _f32(math.sqrt(d)), 1.0
    _group_probs_kernel[(tables, h_kv, b)](
        q, w, out, g, float(g), tau_arg, scale, mean_factor, q.stride(0), q.stride(1), w.stride(0), w.stride(1),
        w.stride(2), out.stride(0), out.stride(1), out.stride(2), D=d, D_PAD=next_pow2(d), G_PAD=g_pad, PLANES=planes,
        P_PAD=max(2, next_pow2(planes)), R_BLOCK=min(r, max(16, next_pow2(tile // g_pad + 1) // 2)), HARD=hard,
        MAX=reduce_max, RECIP=recip, LIBDEVICE=not interpreting(), num_warps=num_warps)
    return out


def _fp32_parts(x: float) -> tuple[float, float, float]:
    """Three fp32 values summing exactly (in fp64) to the double ``x`` (24 + 24 + the last <= 5 bits)."""
    hi = _f32(x)
    mid = _f32(x - hi)
    lo = _f32(x - hi - mid)
    if (hi + mid) + lo != x:
        raise ValueError(f"{x!r} does not split into three fp32 parts")
    return hi, mid, lo


def step_budgets(seqlens: torch.Tensor, heads: int, sink_tokens: int, local_tokens: int, top_k: int | None,
                 density: float | None, forced_share: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``budget_rows`` (``Socket.budget`` on device) for lengths ``seqlens`` [B] in one launch: int32 sink [B],
    local [B] and the scored count of each (row, KV head) [B * heads]. ``top_k`` (an explicit k) replaces the
    ``density`` budget; ``forced_share`` is the most of it sink and local take."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    rows = seqlens.shape[0]
    dev = seqlens.device
    sink = torch.empty(rows, dtype=torch.int32, device=dev)
    local = torch.empty(rows, dtype=torch.int32, device=dev)
    kk = torch.empty(rows * heads, dtype=torch.int32, device=dev)
    if rows:
        seqlens = seqlens if seqlens.stride(0) == 1 else seqlens.contiguous()
        _budget_kernel[(1,)](seqlens, sink, local, kk, rows, heads, _f32(density or 0.0), *_fp32_parts(forced_share),
                             top_k or 0, SINK_TOKENS=sink_tokens, LOCAL_TOKENS=local_tokens,
                             FORCED_DIV=max(1, sink_tokens + local_tokens), DENSITY=top_k is None,
                             BLOCK=max(16, next_pow2(rows)))
    return sink, local, kk
