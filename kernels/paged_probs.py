"""Exact attention probabilities of a decode batch over its paged keys, summed over each KV head's query group.

``q [B, h, d]``, the rows' keys ``kv`` (``formats.PagedKV``), ``width_tokens`` and ``need [B, h_kv]`` bool ->
fp32 ``[B, h_kv, width_tokens]``: ``sum_g softmax_j(q_g . k_j / sqrt(d))`` over the row's n keys (0 past n),
for the pairs in ``need``; the other pairs get zeros and read no key. This is CIS's retrieval score (the
oracle's, over every key): a pair that shares an anchor's set this step needs none, so the kernel skips its
keys while the launch keeps fixed shapes and no host read (it runs inside a captured decode step).

Two launches over (chunk of pages, pair): the first writes each chunk's logits and its per-head running
max and exp-sum, the second combines the chunks' (max, sum) into the row's softmax normaliser and writes
the probabilities. The logits round-trip through memory at 4 bytes per key and query head, against the
256 bytes of a bf16 key of dim 128 that the first launch reads once. The PyTorch form is the reference and
the CPU path.

With ``bounds`` (lo [B], hi [B]) the result is the retrieval's candidate row itself: the probabilities at
keys in [lo, hi) of the needed pairs and -inf everywhere else (the normaliser still spans all n keys). CIS
selects from that row directly, where masking it after the fact took two more passes over [B, h_kv, W].
With ``keep`` (a sink count, with bounds) it is also the step's selection row: the kept keys, below ``keep``
or at or past max(hi, lo) and below n, are +inf (``select_list`` takes them whatever the budget), and the pairs
not needed hold 0 in [lo, hi) (finite: their count is 0, so nothing there is taken unless a +inf is added onto
it, which is how CIS marks a shared anchor's set in place with one ``scatter_add_``). CIS had copied the row
and scattered the +inf in with a max-reduce: a copy and 28 us a layer at 4 x 32K on an H200.
"""

from __future__ import annotations

import math

import torch

from .common import int8_flags, interpreting, next_pow2, tl, triton
from .formats import PagedKV


def paged_group_probs_torch(q: torch.Tensor, kv: PagedKV, width_tokens: int, need: torch.Tensor | None = None,
                            bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
                            keep: int | None = None) -> torch.Tensor:
    """The reference: only the needed pairs' pages are gathered (one copy of their keys, laid out [pair,
    W * page, d]) and scored in fp32."""
    b, h, d = q.shape
    h_kv, page = kv.k.shape[1], kv.k.shape[2]
    g, width = h // h_kv, kv.page_table.shape[1]
    pairs = torch.arange(b * h_kv, device=q.device) if need is None else need.flatten().nonzero().squeeze(1)
    bi, hi = pairs // h_kv, pairs % h_kv
    # Each pair's pages of its KV head as rows of the cache seen as [pages * h_kv, page * d].
    tiles = kv.page_table.long()[bi] * h_kv + hi[:, None]  # [P, W]
    keys = kv.k.reshape(-1, page * d).index_select(0, tiles.flatten()).view(-1, width * page, d)[:, :width_tokens]
    qp = q.float().view(b * h_kv, g, d).index_select(0, pairs)
    logits = torch.bmm(qp, keys.float().transpose(1, 2)).div(math.sqrt(d))  # [P, g, W]
    inrange = torch.arange(width_tokens, device=q.device) < kv.seqlens.long()[bi][:, None]
    probs = logits.masked_fill(~inrange[:, None, :], -math.inf).softmax(-1).sum(1)  # [P, W]
    out = torch.zeros(b * h_kv, width_tokens, dtype=torch.float32, device=q.device)
    out[pairs] = probs
    out = out.view(b, h_kv, width_tokens)
    if bounds is None:
        return out
    pos = torch.arange(width_tokens, device=q.device)
    inside = (pos >= bounds[0][:, None]) & (pos < bounds[1][:, None])  # [B, W]
    rows = torch.ones(b, h_kv, dtype=torch.bool, device=q.device) if need is None else need
    out = out.masked_fill(~(inside[:, None, :] & rows[..., None]), -math.inf)
    if keep is None:
        return out
    out = out.masked_fill(inside[:, None, :] & ~rows[..., None], 0.0)
    n = kv.seqlens.long()[:, None]
    kept = (pos < n) & ((pos < keep) | (pos >= torch.maximum(bounds[1], bounds[0])[:, None]))
    return out.masked_fill(kept[:, None, :], math.inf)


if triton is not None:

    @triton.jit
    def _logits_kernel(Q, K, PT, SEQ, NEED, L, M, S, width, h_kv, wt, sqrt_d,
                       stride_qb, stride_qh, stride_kp, stride_kh, stride_kt, stride_tb,
                       stride_lp, stride_lg, stride_mp, stride_mg,
                       G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                       PAGES: tl.constexpr, PRECISION: tl.constexpr, NATIVE: tl.constexpr):
        c = tl.program_id(0)  # a chunk of PAGES pages of the row
        pair = tl.program_id(1)
        if tl.load(NEED + pair) != 0:
            b = (pair // h_kv).to(tl.int64)
            kvh = (pair % h_kv).to(tl.int64)
            n = tl.load(SEQ + b)
            gi = tl.arange(0, G_PAD)
            d = tl.arange(0, HEAD_DIM)
            # The chunk's PAGES pages in one tile: every page's keys are in flight at once (a loop over the
            # pages issued one page's loads at a time, 2.35 TB/s of keys on an H200).
            t = tl.arange(0, PAGES * PAGE)
            j = c * PAGES + t // PAGE
            tok = c * (PAGES * PAGE) + t
            live = (j < width) & (tok < n)
            pg = tl.load(PT + b * stride_tb + j, mask=j < width, other=0).to(tl.int64)
            k = tl.load(K + pg[:, None] * stride_kp + kvh * stride_kh + (t % PAGE)[:, None] * stride_kt + d[None, :],
                        mask=live[:, None], other=0.0)
            q = tl.load(Q + b * stride_qb + (kvh * G + gi)[:, None] * stride_qh + d[None, :],
                        mask=(gi < G)[:, None], other=0.0)  # [G_PAD, d]
            if NATIVE:  # 16-bit q and k: their products are exact in the fp32 accumulator
                lg = tl.dot(q, tl.trans(k), out_dtype=tl.float32)
            else:
                lg = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PRECISION)
            lg = tl.where(live[None, :], lg / sqrt_d, float("-inf"))  # [G_PAD, PAGES * PAGE]
            m = tl.max(lg, 1)
            safe = tl.where(m == float("-inf"), 0.0, m)
            s = tl.sum(tl.exp(lg - safe[:, None]), 1)
            l_row = L + pair.to(tl.int64) * stride_lp + gi[:, None] * stride_lg
            tl.store(l_row + tok[None, :], lg, mask=(gi < G)[:, None] & (tok < wt)[None, :])
            g_ok = gi < G
            tl.store(M + pair.to(tl.int64) * stride_mp + gi * stride_mg + c, m, mask=g_ok)
            tl.store(S + pair.to(tl.int64) * stride_mp + gi * stride_mg + c, s, mask=g_ok)

    @triton.jit
    def _probs_kernel(SEQ, NEED, L, M, S, Out, LO, HI, h_kv, wt, chunks, keep, stride_lp, stride_lg, stride_mp,
                      stride_mg, stride_op, G: tl.constexpr, G_PAD: tl.constexpr, CHUNK: tl.constexpr,
                      C_PAD: tl.constexpr, BOUNDED: tl.constexpr, KEEP: tl.constexpr):
        c = tl.program_id(0)
        pair = tl.program_id(1).to(tl.int64)
        tok = c * CHUNK + tl.arange(0, CHUNK)
        out_ptr = Out + pair * stride_op + tok
        fill = float("-inf") if BOUNDED else 0.0  # a candidate row, or the plain probabilities
        n = tl.load(SEQ + pair // h_kv)
        if BOUNDED:
            lo = tl.load(LO + pair // h_kv)
            hi = tl.load(HI + pair // h_kv)
            inside = (tok >= lo) & (tok < hi)
            kept = (tok < n) & ((tok < keep) | (tok >= tl.maximum(hi, lo)))
        if tl.load(NEED + pair) != 0:
            gi = tl.arange(0, G_PAD)
            ci = tl.arange(0, C_PAD)
            # Chunks past the row's keys wrote nothing: they count as empty (max -inf, sum 0).
            live = (gi < G)[:, None] & (ci < chunks)[None, :] & (ci * CHUNK < n)[None, :]
            ms = tl.load(M + pair * stride_mp + gi[:, None] * stride_mg + ci[None, :], mask=live,
                         other=float("-inf"))
            ss = tl.load(S + pair * stride_mp + gi[:, None] * stride_mg + ci[None, :], mask=live, other=0.0)
            gm = tl.max(ms, 1)  # [G_PAD]
            gm_safe = tl.where(gm == float("-inf"), 0.0, gm)
            gs = tl.sum(ss * tl.exp(ms - gm_safe[:, None]), 1)
            gs = tl.where(gs > 0, gs, 1.0)
            ok = (gi < G)[:, None] & (tok < n)[None, :]
            lg = tl.load(L + pair * stride_lp + gi[:, None] * stride_lg + tok[None, :], mask=ok, other=float("-inf"))
            p = tl.sum(tl.exp(lg - gm_safe[:, None]) / gs[:, None], 0)
            if BOUNDED:
                p = tl.where(inside, p, fill)
                if KEEP:
                    p = tl.where(kept, float("inf"), p)
            tl.store(out_ptr, p, mask=tok < wt)
        else:
            p = tl.full([CHUNK], fill, dtype=tl.float32)
            if KEEP:  # (BOUNDED too) 0 inside the bounds, for a set's +inf to be added onto
                p = tl.where(kept, float("inf"), tl.where(inside, 0.0, p))
            tl.store(out_ptr, p, mask=tok < wt)


_PAGES_PER_CHUNK = 4  # pages per program: one 64-token page of one KV head is 16 KB of bf16 keys
_TILE_BYTES = 1 << 17  # the largest key tile a program dots (shared memory)


def paged_group_probs(q: torch.Tensor, kv: PagedKV, width_tokens: int, need: torch.Tensor | None = None,
                      bounds: tuple[torch.Tensor, torch.Tensor] | None = None, keep: int | None = None,
                      pages_per_chunk: int = _PAGES_PER_CHUNK, num_warps: int = 4,
                      precision: str | None = None) -> torch.Tensor:
    """The Triton form (``paged_group_probs_torch``'s contract): two launches over (chunk of pages, pair).
    ``pages_per_chunk`` (a power of two), ``num_warps`` and ``precision`` (of the logits' dot: None for the
    default below) are tuning knobs for ``benchmarks/bench_decode_scorers.py``."""
    b, h, d = q.shape
    h_kv, page = kv.k.shape[1], kv.k.shape[2]
    g, width = h // h_kv, kv.page_table.shape[1]
    if keep is not None and (bounds is None or keep < 0):
        raise ValueError(f"keep needs bounds and a sink count >= 0, got {keep}")
    if d < 16 or d & (d - 1) or page < 16 or page & (page - 1) or kv.k.stride(-1) != 1:
        raise ValueError(f"paged_group_probs needs a head dim and page size that are powers of two >= 16 and "
                         f"contiguous keys, got d={d}, page={page}")
    if width_tokens > width * page:
        raise ValueError(f"width_tokens {width_tokens} exceeds the page table's {width} pages of {page}")
    pairs = b * h_kv
    need_i = torch.ones(pairs, dtype=torch.int8, device=q.device) if need is None else int8_flags(need.reshape(pairs))
    q = q if q.stride(-1) == 1 else q.contiguous()
    # 16-bit queries and keys (the serving path's) are exact in TF32's 10-bit mantissa, so plain TF32 tensor
    # cores give the fp32 reference's logits; fp32 inputs take 3xTF32 (fp32-exact to about 1e-6, twice the
    # time on an H200), as plain TF32's 1e-3 would reorder near-equal keys. The interpreter computes in fp32.
    half = q.dtype in (torch.bfloat16, torch.float16) and kv.k.dtype == q.dtype
    if precision is None:
        precision = "ieee" if interpreting() else ("tf32" if half else "tf32x3")
    # 16-bit inputs of one dtype dot natively (bf16 products are exact in fp32: TF32's logits, half the
    # operand bytes); the interpreter's 16-bit dot is not exact, so it stays on the fp32 path.
    native = half and not interpreting() and precision == "tf32"
    # A power of two (the probabilities' chunk is an arange), and a key tile of at most 128 KB: the tile is
    # the dot's operand in shared memory (512 fp32 keys of dim 128 need 270 KB, over an H100's 227 KB).
    per = min(pages_per_chunk, next_pow2(width))
    while per > 1 and per * page * d * (2 if native else 4) > _TILE_BYTES:
        per //= 2
    chunks = -(-width // per)
    g_pad = max(16, next_pow2(g))  # tl.dot's least M
    logits = torch.empty(pairs, g, width * page, dtype=torch.float32, device=q.device)
    m = torch.empty(pairs, g, chunks, dtype=torch.float32, device=q.device)
    s = torch.empty_like(m)
    out = torch.empty(b, h_kv, width_tokens, dtype=torch.float32, device=q.device)
    if pairs == 0 or width == 0:
        return paged_group_probs_torch(q, kv, width_tokens, need, bounds, keep)  # nothing to score
    # Unread without bounds; read at offset row, so contiguous (a broadcast view would read past its element).
    lo, hi = (kv.seqlens, kv.seqlens) if bounds is None else (bounds[0].contiguous(), bounds[1].contiguous())
    _logits_kernel[(chunks, pairs)](
        q, kv.k, kv.page_table, kv.seqlens, need_i, logits, m, s, width, h_kv, width_tokens, math.sqrt(d),
        q.stride(0), q.stride(1), kv.k.stride(0), kv.k.stride(1), kv.k.stride(2), kv.page_table.stride(0),
        logits.stride(0), logits.stride(1), m.stride(0), m.stride(1),
        G=g, G_PAD=g_pad, HEAD_DIM=d, PAGE=page, PAGES=per, PRECISION=precision, NATIVE=native,
        num_warps=num_warps)
    chunk = per * page
    out_chunks = -(-width_tokens // chunk)
    _probs_kernel[(out_chunks, pairs)](
        kv.seqlens, need_i, logits, m, s, out, lo, hi, h_kv, width_tokens, chunks, keep or 0, logits.stride(0),
        logits.stride(1), m.stride(0), m.stride(1), width_tokens, G=g, G_PAD=max(2, next_pow2(g)), CHUNK=chunk,
        C_PAD=max(2, next_pow2(chunks)), BOUNDED=bounds is not None, KEEP=keep is not None, num_warps=4)
    return out
