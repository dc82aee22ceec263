"""Sketch&Walk's per-layer decode update in two launches (the graph path's hot loop, ``sketch_walk_graph``).

The PyTorch form of this step issues ~45 small kernels per sparse layer; captured in a CUDA graph they
still cost ~2-3 us each. Here:

``_row_kernel`` (one program per batch row): folds the new token's sketches into its slot's current block
sums, scores the current query block's row of A_hat against every causal key block twice (the block
mean's query, kept in the state, and the new token's own query, used by this step's walk), rounds both to
bf16 as the reference caches A_hat, and turns them into W rows (rollout: row-softmax(s * A) mixed with the
identity; product and one-hop: P ** s). The mean's row is written into the slot's W; both rows go to scratch.

``_walk_kernel`` (rows x column tiles): R_row = (prev / sum(prev)) @ W', W' being W with the current row
replaced by this step's token row (added as a rank-one correction), reading only rows 0..cb of W.

Rows come back unnormalised (a scale changes no ranking; the next layer normalises what it reads).

Status: correct (tests/test_walk_decode.py) but slower than the PyTorch form it replaces on an H200 (8B
config, 64K: the walk kernel 348 us and the row kernel 76 us per layer, as one program per row and nine
column tiles leave the GPU idle), so it is opt-in (``RAYSPARSE_WALK_KERNEL=on``) until the GEMV is split
over the rows of W as well.
"""

from __future__ import annotations

import math

import torch

from .common import tl, triton

_TW = 128  # key blocks per tile of the row kernel
_TJ = 128  # output columns per program of the walk kernel
_TI = 32  # W rows per step of the walk kernel

if triton is not None:

    @triton.jit
    def _row_kernel(QS, KS, W, SLOTS, N, NEW, MEAN, CALL, s_q0, s_q1, s_w0, s_w1, s_new0,
                    exponent, residual, inv_sqrt_r,
                    B: tl.constexpr, R: tl.constexpr, WID: tl.constexpr, TW: tl.constexpr,
                    PRODUCT: tl.constexpr, TOKEN: tl.constexpr):
        b = tl.program_id(0)
        slot = tl.load(SLOTS + b)
        nn = tl.load(N + b)
        cb = (nn - 1) // B
        rr = tl.arange(0, R)
        qsum = tl.load(QS + slot * s_q0 + cb * s_q1 + rr) + tl.load(NEW + b * R + rr)
        ksum = tl.load(KS + slot * s_q0 + cb * s_q1 + rr) + tl.load(NEW + s_new0 + b * R + rr)
        tl.store(QS + slot * s_q0 + cb * s_q1 + rr, qsum)
        tl.store(KS + slot * s_q0 + cb * s_q1 + rr, ksum)
        q_mean = qsum / tl.minimum(nn - cb * B, B).to(tl.float32)
        q_tok = tl.load(NEW + b * R + rr)
        m_mean = float("-inf")
        m_call = float("-inf")
        for t in tl.range(0, WID, TW):  # pass 1: bf16-rounded A_hat rows into scratch, and their maxima
            cols = t + tl.arange(0, TW)
            inb = cols < WID
            ok = (cols <= cb) & inb
            kt = tl.load(KS + slot * s_q0 + cols[:, None] * s_q1 + rr[None, :], mask=ok[:, None], other=0.0)
            kt = tl.where((cols == cb)[:, None], ksum[None, :], kt)  # this step's sum, not the stale load
            k_mean = kt / tl.minimum(tl.maximum(nn - cols * B, 1), B).to(tl.float32)[:, None]
            a = tl.sum(k_mean * q_mean[None, :], 1) * inv_sqrt_r
            a = tl.where(ok, a.to(tl.bfloat16).to(tl.float32), float("-inf"))
            tl.store(MEAN + b * WID + cols, a, mask=inb)
            m_mean = tl.maximum(m_mean, tl.max(a, 0))
            if TOKEN:
                c = tl.sum(k_mean * q_tok[None, :], 1) * inv_sqrt_r
                c = tl.where(ok, c.to(tl.bfloat16).to(tl.float32), float("-inf"))
                tl.store(CALL + b * WID + cols, c, mask=inb)
                m_call = tl.maximum(m_call, tl.max(c, 0))
        # pass 2: the normalisers (rollout: softmax of s * A; product: log-softmax of A, then ** s)
        z_mean = 0.0
        z_call = 0.0
        for t in tl.range(0, WID, TW):
            cols = t + tl.arange(0, TW)
            inb = cols < WID
            z_mean += _partition(tl.load(MEAN + b * WID + cols, mask=inb, other=float("-inf")), m_mean, exponent,
                                 PRODUCT)
            if TOKEN:
                z_call += _partition(tl.load(CALL + b * WID + cols, mask=inb, other=float("-inf")), m_call,
                                     exponent, PRODUCT)
        for t in tl.range(0, WID, TW):  # pass 3: W rows
            cols = t + tl.arange(0, TW)
            inb = cols < WID
            wm = _w_entries(tl.load(MEAN + b * WID + cols, mask=inb, other=float("-inf")), m_mean, z_mean, cols, cb,
                            exponent, residual, PRODUCT)
            tl.store(MEAN + b * WID + cols, wm, mask=inb)
            tl.store(W + slot * s_w0 + cb * s_w1 + cols, wm, mask=inb)
            if TOKEN:
                wm = _w_entries(tl.load(CALL + b * WID + cols, mask=inb, other=float("-inf")), m_call, z_call, cols,
                                cb, exponent, residual, PRODUCT)
            tl.store(CALL + b * WID + cols, wm, mask=inb)

    @triton.jit
    def _partition(x, m, exponent, PRODUCT: tl.constexpr):
        """One tile's share of a W row's normaliser, for scores x with running maximum m."""
        if PRODUCT:
            return tl.sum(tl.exp(x - m), 0)
        return tl.sum(tl.exp(exponent * (x - m)), 0)

    @triton.jit
    def _w_entries(x, m, z, cols, cb, exponent, residual, PRODUCT: tl.constexpr):
        """W entries of one tile: P ** s (product, one-hop) or the rollout's softmax(s * A) plus the identity."""
        if PRODUCT:
            return tl.exp(exponent * (x - m - tl.log(z)))
        return tl.exp(exponent * (x - m)) / z * (1.0 - residual) + tl.where(cols == cb, residual, 0.0)

    @triton.jit
    def _walk_kernel(W, SLOTS, N, PREV, MEAN, CALL, OUT, s_w0, s_w1, s_p,
                     B: tl.constexpr, WID: tl.constexpr, TJ: tl.constexpr, TI: tl.constexpr):
        b = tl.program_id(0)
        jt = tl.program_id(1)
        slot = tl.load(SLOTS + b)
        cb = (tl.load(N + b) - 1) // B
        cols = jt * TJ + tl.arange(0, TJ)
        inb = cols < WID
        total = 0.0
        for i0 in tl.range(0, WID, TJ):
            ii = i0 + tl.arange(0, TJ)
            total += tl.sum(tl.load(PREV + b * s_p + ii, mask=ii < WID, other=0.0), 0)
        acc = tl.zeros((TJ,), dtype=tl.float32)
        for i0 in tl.range(0, cb + 1, TI):
            ii = i0 + tl.arange(0, TI)
            ok = ii <= cb
            p = tl.load(PREV + b * s_p + ii, mask=ok, other=0.0)
            wt = tl.load(W + slot * s_w0 + ii[:, None] * s_w1 + cols[None, :], mask=ok[:, None] & inb[None, :],
                         other=0.0)
            acc += tl.sum(p[:, None] * wt, 0)
        p_cb = tl.load(PREV + b * s_p + cb)
        corr = tl.load(CALL + b * WID + cols, mask=inb, other=0.0) - tl.load(MEAN + b * WID + cols, mask=inb, other=0.0)
        tl.store(OUT + b * WID + cols, (acc + p_cb * corr) / tl.maximum(total, 1e-38), mask=inb)


def walk_decode_rows(qs: torch.Tensor, ks: torch.Tensor, w: torch.Tensor, slots: torch.Tensor, n: torch.Tensor,
                     new: torch.Tensor, prev: torch.Tensor | None, block: int, exponent: float, residual: float,
                     product: bool, token_query: bool) -> torch.Tensor:
    """qs, ks [S, >= WID, r] and w [S, >= WID, >= WID] fp32 views (one sparse layer), slots / n [bsz] int64,
    new [2, bsz, r] fp32 (the token's q and k sketches), prev [bsz, WID] or None (first sparse layer and
    one-hop: this step's row alone). Updates the state in place; returns rows [bsz, WID] fp32."""
    bsz, r = slots.shape[0], new.shape[-1]
    wid = w.shape[-1]
    tw = min(_TW, 1 << (wid - 1).bit_length())
    if r & (r - 1) or qs.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("walk_decode_rows needs a power-of-two sketch dim and unit last strides")
    new = new.contiguous()
    mean = torch.empty(bsz, wid, dtype=torch.float32, device=w.device)
    call = torch.empty_like(mean)
    _row_kernel[(bsz,)](qs, ks, w, slots, n, new, mean, call, qs.stride(0), qs.stride(1), w.stride(0), w.stride(1),
                        new.stride(0), float(exponent), float(residual), 1.0 / math.sqrt(r), B=block, R=r, WID=wid,
                        TW=tw, PRODUCT=product, TOKEN=token_query, num_warps=4)
    if prev is None:
        return call
    out = torch.empty_like(mean)
    tj = min(_TJ, 1 << (wid - 1).bit_length())
    _walk_kernel[(bsz, -(-wid // tj))](w, slots, n, prev, mean, call, out, w.stride(0), w.stride(1), prev.stride(0),
                                   B=block, WID=wid, TJ=tj, TI=_TI, num_warps=4)
    return out
