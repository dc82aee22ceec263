"""Quest's decode page scores for a batch, read from per-page bounds through the page table.

``q [B, h, d]``, ``lo, hi [pages + 1, h_kv, S, d]`` (per cache page and KV head, the element-wise min and max
of the keys of each of its S Quest pages), ``page_table [B, W]`` int32, ``seqlens [B]`` -> fp32
``[B, h_kv, W * S]``: the upper bound ``max_g sum_d max(q_d lo_d, q_d hi_d)`` of each Quest page, with the
selection's encoding folded in: +inf for the forced pages (the first and the current one), -inf past the
row's last page. Fixed shapes, no host read (it runs inside a captured decode step); it reads the bounds
only, an eighth of K's bytes at Quest's default 16-token pages. The PyTorch form is the reference and the
CPU path.
"""

from __future__ import annotations

import math

import torch

from .common import next_pow2, tl, triton


def paged_quest_scores_torch(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, page_table: torch.Tensor,
                             seqlens: torch.Tensor, quest_page: int) -> torch.Tensor:
    b, h, d = q.shape
    h_kv = lo.shape[1]
    table = page_table.long()
    lo_r = lo[table].permute(0, 2, 1, 3, 4).reshape(b, h_kv, -1, d)  # [B, h_kv, W * S, d]
    hi_r = hi[table].permute(0, 2, 1, 3, 4).reshape(b, h_kv, -1, d)
    qg = q.float().view(b, h_kv, -1, d)
    score = (qg.clamp(min=0) @ hi_r.float().mT + qg.clamp(max=0) @ lo_r.float().mT).amax(2)
    return _encode(score, seqlens, quest_page)


def _encode(score: torch.Tensor, seqlens: torch.Tensor, quest_page: int) -> torch.Tensor:
    n_pages = (seqlens.long() + quest_page - 1) // quest_page
    j = torch.arange(score.shape[-1], device=score.device)
    forced = (j == 0) | (j == n_pages[:, None] - 1)
    # Python scalars, not device tensors: a host-to-device copy cannot sit inside a graph capture.
    out = torch.where((j < n_pages[:, None])[:, None], score, -math.inf)
    return torch.where(forced[:, None], math.inf, out)


if triton is not None:

    @triton.jit
    def _quest_kernel(Q, LO, HI, PT, SEQ, Out, width, stride_qb, stride_qh, stride_lp, stride_lh, stride_ls,
                      stride_tb, stride_ob, stride_oh, QPAGE: tl.constexpr, S: tl.constexpr, G: tl.constexpr,
                      G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGES: tl.constexpr):
        kvh = tl.program_id(1).to(tl.int64)
        b = tl.program_id(2).to(tl.int64)
        n = tl.load(SEQ + b)
        n_pages = (n + QPAGE - 1) // QPAGE
        s = tl.arange(0, S)
        gi = tl.arange(0, G_PAD)
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + b * stride_qb + (kvh * G + gi)[:, None] * stride_qh + d[None, :],
                    mask=(gi < G)[:, None], other=0.0).to(tl.float32)  # [G_PAD, d], loaded once for PAGES pages
        for i in range(PAGES):  # cache pages of the row, each with its S Quest pages
            j = tl.program_id(0) * PAGES + i
            qp = j * S + s  # Quest page ids
            out_ptr = Out + b * stride_ob + kvh * stride_oh + qp
            if j < width:
                if j * S < n_pages:
                    pg = tl.load(PT + b * stride_tb + j).to(tl.int64)
                    base = pg * stride_lp + kvh * stride_lh + s[:, None] * stride_ls + d[None, :]  # [S, d]
                    lo = tl.load(LO + base).to(tl.float32)
                    hi = tl.load(HI + base).to(tl.float32)
                    # every query head of the group at once: [G_PAD, S, d] -> [G_PAD, S], then the max over g
                    ub = tl.sum(tl.maximum(q[:, None, :] * lo[None, :, :], q[:, None, :] * hi[None, :, :]), 2)
                    best = tl.max(tl.where((gi < G)[:, None], ub, float("-inf")), 0)
                    res = tl.where(qp < n_pages, best, float("-inf"))
                    res = tl.where((qp == 0) | (qp == n_pages - 1), float("inf"), res)
                    tl.store(out_ptr, res)
                else:
                    tl.store(out_ptr, tl.full([S], float("-inf"), tl.float32))


_PAGES_PER_PROGRAM = 8  # cache pages per program: one page's bounds are a few KB, too little work alone


def paged_quest_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, page_table: torch.Tensor,
                       seqlens: torch.Tensor, quest_page: int) -> torch.Tensor:
    """The Triton form: one program per (up to ``_PAGES_PER_PROGRAM`` cache pages of the row, KV head, row)."""
    b, h, d = q.shape
    _, h_kv, sub, _ = lo.shape
    width = page_table.shape[1]
    if lo.stride(-1) != 1 or hi.stride() != lo.stride() or q.stride(-1) != 1:
        raise ValueError("bounds need one contiguous layout and q a contiguous head dim")
    out = torch.empty(b, h_kv, width * sub, dtype=torch.float32, device=q.device)
    g = h // h_kv
    per = min(_PAGES_PER_PROGRAM, width)
    _quest_kernel[(-(-width // per), h_kv, b)](
        q, lo, hi, page_table, seqlens, out, width, q.stride(0), q.stride(1), lo.stride(0), lo.stride(1),
        lo.stride(2), page_table.stride(0), out.stride(0), out.stride(1), QPAGE=quest_page, S=sub, G=g,
        G_PAD=max(2, next_pow2(g)), HEAD_DIM=d, PAGES=per, num_warps=4)
    return out
