"""Quest's decode page scores for a batch, read from per-page bounds through the page table.

``q [B, h, d]``, ``lo, hi [pages + 1, h_kv, S, d]`` (per cache page and KV head, the element-wise min and max
of the keys of each of its S Quest pages), ``page_table [B, W]`` int32, ``seqlens [B]`` -> fp32
``[B, h_kv, W * S]``: the upper bound ``max_g sum_d max(q_d lo_d, q_d hi_d)`` of each Quest page, with the
selection's encoding folded in: +inf for the forced pages (the first and the current one), -inf past the
row's last page (``forced=False``: the first and current pages keep their bounds, for a caller whose
candidates need not include them, as CIS's page retrieval's do not). Fixed shapes, no host read (it runs
inside a captured decode step); it reads the bounds only, an eighth of K's bytes at Quest's default 16-token
pages. The PyTorch form is the reference and the CPU path.

The kernel is bound by the gathered bounds' bytes, so its tile is shaped for loads in flight: one program
takes ``ROWS`` (32) consecutive Quest pages of one row and KV head, i.e. ROWS / S cache pages, and gathers
their bounds through the page table in one ``[ROWS, d]`` load of each of lo and hi (8 KB each in bf16 at
d = 128), 8 warps wide: many small programs per SM keep enough gathers in flight, where 64-128 rows
measured no faster and spill at fewer warps. The upper bound is then, per query head of the group (any
count), ``q+ . hi + q- . lo`` as fp32 FMAs over the tile and one reduction over d (exact fp32 products, as
in the reference; bounds up-cast on load), maxed over the group. Measured (batch 4 x 32768 tokens,
Llama-3.1-8B's heads, bf16 bounds, 64-token cache pages, CUDA-graph replay, L2 flushed): 24 us per layer
on an H100 and 20 us on an H200, against 54 us for the earlier loop over one cache page's ``[S, d]`` tile
at a time (latency bound) and 16 us on the H200 for the same gather with no arithmetic. Two ``tl.dot``s
with the group as the M side (padded to 16 heads) measured 100-160 us in ``ieee`` precision (Triton's FMA
dot); a bf16 tensor-core dot (exact products for bf16 inputs) measured 18 us but accumulates in the MMA's
order and cannot be checked by the interpreter, and TF32 on fp32 bounds reorders nearly tied pages.
"""

from __future__ import annotations

import math

import torch

from .common import next_pow2, tl, triton


def paged_quest_scores_torch(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, page_table: torch.Tensor,
                             seqlens: torch.Tensor, quest_page: int, forced: bool = True) -> torch.Tensor:
    b, h, d = q.shape
    h_kv = lo.shape[1]
    table = page_table.long()
    lo_r = lo[table].permute(0, 2, 1, 3, 4).reshape(b, h_kv, -1, d)  # [B, h_kv, W * S, d]
    hi_r = hi[table].permute(0, 2, 1, 3, 4).reshape(b, h_kv, -1, d)
    qg = q.float().view(b, h_kv, -1, d)
    score = (qg.clamp(min=0) @ hi_r.float().mT + qg.clamp(max=0) @ lo_r.float().mT).amax(2)
    return _encode(score, seqlens, quest_page, forced)


def _encode(score: torch.Tensor, seqlens: torch.Tensor, quest_page: int, forced: bool) -> torch.Tensor:
    n_pages = (seqlens.long() + quest_page - 1) // quest_page
    j = torch.arange(score.shape[-1], device=score.device)
    # Python scalars, not device tensors: a host-to-device copy cannot sit inside a graph capture.
    out = torch.where((j < n_pages[:, None])[:, None], score, -math.inf)
    if not forced:
        return out
    return torch.where(((j == 0) | (j == n_pages[:, None] - 1))[:, None], math.inf, out)


if triton is not None:

    @triton.jit
    def _quest_kernel(Q, LO, HI, PT, SEQ, Out, width, stride_qb, stride_qh, stride_lp, stride_lh, stride_ls,
                      stride_tb, stride_ob, stride_oh, QPAGE: tl.constexpr, S: tl.constexpr, G: tl.constexpr,
                      HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, FORCED: tl.constexpr):
        kvh = tl.program_id(1).to(tl.int64)
        b = tl.program_id(2).to(tl.int64)
        n = tl.load(SEQ + b)
        n_pages = (n + QPAGE - 1) // QPAGE
        qp = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # the tile's Quest pages, of the row's W * S
        in_width = qp < width * S
        if tl.program_id(0) * ROWS < n_pages:
            d = tl.arange(0, HEAD_DIM)
            # Past the row's pages the table may hold anything (stale or scratch pages): neither it nor the
            # bounds are read there. Row r's cache page j = qp // S (S rows share one table entry).
            live = (qp < n_pages) & in_width
            pg = tl.load(PT + b * stride_tb + qp // S, mask=live, other=0).to(tl.int64)
            off = pg[:, None] * stride_lp + kvh * stride_lh + (qp % S)[:, None] * stride_ls + d[None, :]
            hi = tl.load(HI + off, mask=live[:, None], other=0.0).to(tl.float32)  # [ROWS, d]
            lo = tl.load(LO + off, mask=live[:, None], other=0.0).to(tl.float32)
            best = tl.full([ROWS], float("-inf"), tl.float32)
            for g in tl.static_range(G):  # sum_d max(q lo, q hi) = q+ . hi + q- . lo, per query head
                qg = tl.load(Q + b * stride_qb + (kvh * G + g) * stride_qh + d).to(tl.float32)
                ub = tl.sum(hi * tl.maximum(qg, 0.0)[None, :] + lo * tl.minimum(qg, 0.0)[None, :], 1)
                best = tl.maximum(best, ub)
            res = tl.where(qp < n_pages, best, float("-inf"))
        else:  # the whole tile is past the row's pages
            res = tl.full([ROWS], float("-inf"), tl.float32)
        if FORCED:
            res = tl.where((qp == 0) | (qp == n_pages - 1), float("inf"), res)
        tl.store(Out + b * stride_ob + kvh * stride_oh + qp, res, mask=in_width)


_ROWS = 32  # Quest pages (bounds rows) per program
_WARPS = 8


def paged_quest_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, page_table: torch.Tensor,
                       seqlens: torch.Tensor, quest_page: int, forced: bool = True, rows: int = _ROWS,
                       num_warps: int = _WARPS) -> torch.Tensor:
    """The Triton form: one program per (``rows`` consecutive Quest pages of the row, KV head, row).
    ``rows`` (a power of two) and ``num_warps`` are knobs for ``benchmarks/bench_decode_scorers.py``."""
    b, h, d = q.shape
    _, h_kv, sub, _ = lo.shape
    width = page_table.shape[1]
    if lo.stride(-1) != 1 or hi.stride() != lo.stride() or q.stride(-1) != 1:
        raise ValueError("bounds need one contiguous layout and q a contiguous head dim")
    if d & (d - 1) or rows < 1 or rows & (rows - 1):
        raise ValueError(f"the head dim and rows must be powers of two, got {d} and {rows}")
    out = torch.empty(b, h_kv, width * sub, dtype=torch.float32, device=q.device)
    rows = min(rows, next_pow2(width * sub))
    if out.numel():
        _quest_kernel[(-(-(width * sub) // rows), h_kv, b)](
            q, lo, hi, page_table, seqlens, out, width, q.stride(0), q.stride(1), lo.stride(0), lo.stride(1),
            lo.stride(2), page_table.stride(0), out.stride(0), out.stride(1), QPAGE=quest_page, S=sub,
            G=h // h_kv, HEAD_DIM=d, ROWS=rows, FORCED=forced, num_warps=num_warps)
    return out
