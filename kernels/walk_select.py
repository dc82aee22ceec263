"""Sketch&Walk's one-hop decode selection in two launches (the graph path, ``sketch_walk_rows``).

For ``walk="one-hop"`` a decode step's block list depends only on this layer's row of A_hat, so the
PyTorch form (state update, scores, ``_w_rows``, ``_choose``: ~40 small kernels per sparse layer) becomes:

``_score_kernel`` (batch rows x tiles of key blocks, so a long row's GEMV is spread over many programs):
scores the current query block's row against every causal key block mean, with the new token's sketches
folded into the current block's sums in registers, and writes the logits rounded to bf16 as the reference
caches A_hat. The query is the new token's own sketch (``token_query`` "decode"/"last") or the current
block's mean ("never"). The state is not written here: every program of a row reads the current block's
old sums, and a store by one of them could land before another's load.

``_select_kernel`` (one program per batch row): stores the updated sums, then picks the sink, the local
blocks and the top-(tau - forced) candidates and writes the ascending, -1 padded list of ``_choose``.
The top-k is a bisection over 16-bit ordered keys (count of keys >= mid) and ``tl.cumsum`` places the
picks, so nothing is sorted.

Ranking. The reference ranks by exp(s * log_softmax(x)) / sum, x the bf16 logits: monotonic in x, so
this kernel ranks by x itself (the bf16 bits as an ordered integer), ties toward the lower block. Where
the reference's fp32 exp underflows to 0 (s * log_softmax(x) <= ln 2^-150) its values tie; the kernel
finds those entries from its own max and log-sum-exp and gives them one shared lowest key, so they too go
to the lower block. What it does not reproduce: two distinct logits whose reference values round equal
(subnormal results just above the underflow, or |x| so small that x - max - lse rounds both alike), and
an entry within an ulp of the underflow threshold, where the two log-sum-exps' summation orders differ;
``benchmarks/bench_walk_select.py --agreement`` counts how often that changes a block list. With s < 1
the reference's division by the row sum (> 1 then) can also flush a subnormal to 0, which is not modelled.
The A_hat dot product is summed in another order than the reference's matmul, so a score on a bf16
rounding boundary can round the other way: the reference's own CPU and CUDA results differ the same way.
Measured on the default model over real text (CPU, the kernel interpreted; ``bench_walk_select.py
--agreement``): 4096 tokens, 2 rows, 6 steps: 6 of 336 block lists differ, each by one block of ~7, all
from score rounding; the ranking rule alone (``--rule-only``, 8192 tokens, 2 rows, 8 steps, token_query
"last" and "never"): 0 of 448 lists each.

The W matrix is not written: one-hop never reads it.
"""

from __future__ import annotations

import math

import torch

from .common import fp32_value, row_budget_units, tl, triton

# ln(2^-150): exp(y) rounds to 0 in fp32 at and below it (half the smallest subnormal, ties to even)
ZERO_Y = -150.0 * math.log(2.0)


if triton is not None:

    @triton.jit
    def _score_kernel(QS, KS, SLOTS, N, NEW, X, s_q0, s_q1, s_new0, sqrt_r,
                      B: tl.constexpr, R: tl.constexpr, WID: tl.constexpr, TW: tl.constexpr, TOKEN: tl.constexpr):
        b = tl.program_id(0)
        cols = tl.program_id(1) * TW + tl.arange(0, TW)
        slot = tl.load(SLOTS + b)
        nn = tl.load(N + b)
        cb = (nn - 1) // B
        rr = tl.arange(0, R)
        q_new = tl.load(NEW + b * R + rr)
        if TOKEN:
            q = q_new
        else:  # the reference's q_sum / count, in the same fp32 steps (IEEE division: `/` is approximate on GPUs)
            q = tl.div_rn(tl.load(QS + slot * s_q0 + cb * s_q1 + rr) + q_new, tl.minimum(nn - cb * B, B).to(tl.float32))
        ok = (cols <= cb) & (cols < WID)
        kt = tl.load(KS + slot * s_q0 + cols[:, None] * s_q1 + rr[None, :], mask=ok[:, None], other=0.0)
        kt = tl.where((cols == cb)[:, None], kt + tl.load(NEW + s_new0 + b * R + rr)[None, :], kt)
        k_mean = tl.div_rn(kt, tl.minimum(tl.maximum(nn - cols * B, 1), B).to(tl.float32)[:, None])
        a = tl.div_rn(tl.sum(k_mean * q[None, :], 1), sqrt_r)
        a = tl.where(ok, a, 0.0).to(tl.bfloat16).to(tl.float32)
        tl.store(X + b * WID + cols, tl.where(ok, a, float("-inf")), mask=cols < WID)

    @triton.jit
    def _select_kernel(QS, KS, SLOTS, N, NEW, X, OUT, s_q0, s_q1, s_new0, density, exponent, zero_y,
                       B: tl.constexpr, R: tl.constexpr, WID: tl.constexpr, WP: tl.constexpr,
                       LOCAL: tl.constexpr, K: tl.constexpr, OUTW: tl.constexpr, OP: tl.constexpr):
        b = tl.program_id(0)
        slot = tl.load(SLOTS + b)
        cb = (tl.load(N + b) - 1) // B
        rr = tl.arange(0, R)
        # the state update (padded rows all write the scratch slot: any of them may win)
        at = slot * s_q0 + cb * s_q1 + rr
        tl.store(QS + at, tl.load(QS + at) + tl.load(NEW + b * R + rr))
        tl.store(KS + at, tl.load(KS + at) + tl.load(NEW + s_new0 + b * R + rr))

        cols = tl.arange(0, WP)
        x = tl.load(X + b * WID + cols, mask=cols < WID, other=float("-inf"))
        m = tl.max(x, 0)
        lse = tl.log(tl.sum(tl.exp(x - m), 0))
        live = exponent * ((x - m) - lse) > zero_y  # the reference's exp(s * log_softmax) is not 0
        xb = tl.where(x == 0.0, 0.0, x)  # -0.0 and +0.0 score alike
        bits = xb.to(tl.int32, bitcast=True)
        key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)) >> 16  # float order as int order; bf16: low half is zero
        cand = (cols >= 1) & (cols <= cb - LOCAL)
        # keys: bf16 ones in [-32768, 32767]; every underflowed candidate -32769; non-candidates below
        key = tl.where(cand, tl.where(live, key, -32769), -65536)

        tau = row_budget_units(cb + 1, density)  # the blocks a row keeps, forced ones counted (row_budget)
        kk = tl.minimum(tl.maximum(tau - tl.minimum(cb + 1, LOCAL + 1), 0), K).to(tl.int32)

        # the largest lo with count(key >= lo) >= kk (keys span [-32769, 32767]: 17 halvings)
        lo = tl.full((), -32769, tl.int32)
        hi = tl.full((), 32768, tl.int32)
        for _ in tl.static_range(17):
            mid = (lo + hi) >> 1
            enough = tl.sum((key >= mid).to(tl.int32), 0) >= kk
            lo = tl.where(enough, mid, lo)
            hi = tl.where(enough, hi, mid)
        gt = key > lo
        tie = key == lo
        sel = gt | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= kk - tl.sum(gt.to(tl.int32), 0)))
        # ascending list: the sink, the picks (all between it and the local blocks), the local blocks, -1s
        sel_i = sel.to(tl.int32)
        npick = tl.sum(sel_i, 0)
        tl.store(OUT + b * OUTW + tl.cumsum(sel_i, 0), cols, mask=sel)
        first_local = tl.maximum(cb - LOCAL + 1, 1)
        p = tl.arange(0, OP)
        j = p - 1 - npick
        val = tl.where(p == 0, 0, tl.where(j < cb - first_local + 1, first_local + j, -1))
        tl.store(OUT + b * OUTW + p, val.to(tl.int32), mask=(p < OUTW) & ((p == 0) | (p > npick)))


def walk_select(qs: torch.Tensor, ks: torch.Tensor, slots: torch.Tensor, n: torch.Tensor, new: torch.Tensor,
                block: int, density: float, local_blocks: int, exponent: float, token_query: bool, width: int,
                out_width: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """qs, ks [S, >= width, r] fp32 views of one sparse layer's slot state (unit last stride), slots / n [bsz]
    (the rows' slots and lengths), new [2, bsz, r] fp32 (the token's q and k sketches). Adds ``new`` into the
    current blocks' sums in place; returns the block lists [bsz, out_width] int32 (``_choose``'s form), in
    ``out`` if given (contiguous)."""
    bsz, r = slots.shape[0], new.shape[-1]
    k = out_width - 1 - local_blocks
    if r & (r - 1) or qs.stride(-1) != 1 or ks.stride() != qs.stride() or qs.shape[1] < width or k < 0:
        raise ValueError("walk_select needs a power-of-two sketch dim, qs/ks alike with unit last strides, "
                         "width <= their blocks and out_width >= 1 + local_blocks")
    new = new.contiguous()
    x = torch.empty(bsz, width, dtype=torch.float32, device=new.device)
    if out is None:
        out = torch.empty(bsz, out_width, dtype=torch.int32, device=new.device)
    wp = 1 << (width - 1).bit_length()
    # ~32 programs per row at w = 1024-2048 (r = 64): the GEMV is spread, a tile stays 4-16 KiB
    tw = max(16, min(64, wp // 32))
    _score_kernel[(bsz, -(-width // tw))](qs, ks, slots, n, new, x, qs.stride(0), qs.stride(1), new.stride(0),
                                          math.sqrt(r), B=block, R=r, WID=width, TW=tw, TOKEN=token_query,
                                          num_warps=4)
    dens = fp32_value(density)
    _select_kernel[(bsz,)](qs, ks, slots, n, new, x, out, qs.stride(0), qs.stride(1), new.stride(0),
                           dens, float(exponent), ZERO_Y, B=block, R=r, WID=width, WP=wp,
                           LOCAL=local_blocks, K=k, OUTW=out_width, OP=1 << (out_width - 1).bit_length(),
                           num_warps=8 if wp >= 1024 else 4)
    return out
