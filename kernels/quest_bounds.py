"""Quest's kernels (reference: ``scorer_reference``): per-page element-wise key bounds and the page scores.

Bounds: keys ``k [h_kv, n, d]`` (any strides with a contiguous last dim, so a cache slice is passed as a
view) -> ``lo, hi [h_kv, ceil(n / page), d]`` in K's dtype (min / max are exact in any dtype). One program
reduces ``PAGES`` consecutive pages of one head from a single ``[PAGES * page, d]`` tile; a partial last
page reduces only the keys it has.

Paged bounds (``update_page_bounds``): Quest's per-cache-page pools ``lo, hi [num_pages + 1, h_kv, S, d]`` (S
Quest pages of ``page`` tokens per cache page), recomputed for the Quest page each listed token lies in, from its
keys up to that token, read in place from the paged cache ``k [num_pages, h_kv, page_size, d]``. One program per
(token, KV head) in one launch, with no host read, so a captured decode step keeps it: the PyTorch form (the
gather, two masked reductions and two scatters of ``Quest.update_state``) took ~30 us a sparse layer in small
launches on the H200, whatever the batch. Min and max are exact, so the pools are the PyTorch form's bit for bit.

Scores: ``q [h_kv, g, m, d]`` (m query rows per head: 1 in decode, the query blocks' means in Quest's
prefill), bounds ``[h_kv, P, d]`` -> fp32 ``[h_kv, m, P]``: the upper bound sum_d max(q_d lo_d, q_d hi_d)
= q+ . hi + q- . lo of each query head, reduced over the group by max. One program scores ``BLOCK_P``
pages for one row of one KV head with its g query heads as the M side of two exact-fp32 products
(bounds up-cast on load; ``ieee``, since TF32 would reorder nearly tied pages against the reference).
"""

from __future__ import annotations

import torch

from .common import next_pow2, tl, triton

_PAGES = 8  # pages per bounds program
_BLOCK_P = 64  # pages per scoring program


if triton is not None:

    @triton.jit
    def _bounds_kernel(K, Lo, Hi, n, pages, stride_kh, stride_kt, stride_bh, stride_bp,
                       PAGE: tl.constexpr, PAGES: tl.constexpr, HEAD_DIM: tl.constexpr):
        pb = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        t = pb * PAGES * PAGE + tl.arange(0, PAGES * PAGE)
        d = tl.arange(0, HEAD_DIM)
        ok = (t < n)[:, None]
        x = tl.load(K + h * stride_kh + t.to(tl.int64)[:, None] * stride_kt + d[None, :], mask=ok, other=0.0)
        lo = tl.min(tl.reshape(tl.where(ok, x, float("inf")), [PAGES, PAGE, HEAD_DIM]), 1)
        hi = tl.max(tl.reshape(tl.where(ok, x, float("-inf")), [PAGES, PAGE, HEAD_DIM]), 1)
        pg = pb * PAGES + tl.arange(0, PAGES)
        off = h * stride_bh + pg.to(tl.int64)[:, None] * stride_bp + d[None, :]
        p_ok = (pg < pages)[:, None]
        tl.store(Lo + off, lo.to(Lo.dtype.element_ty), mask=p_ok)
        tl.store(Hi + off, hi.to(Hi.dtype.element_ty), mask=p_ok)

    @triton.jit
    def _update_kernel(K, Lo, Hi, PAGES, OFFS, s_kp, s_kh, s_kt, s_bp, s_bh, s_bs,
                       PAGE: tl.constexpr, PP: tl.constexpr, HEAD_DIM: tl.constexpr):
        m = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        page = tl.load(PAGES + m).to(tl.int64)
        off = tl.load(OFFS + m).to(tl.int64)
        sub = off // PAGE
        t = tl.arange(0, PP)
        d = tl.arange(0, HEAD_DIM)
        ok = ((t < PAGE) & (t <= off % PAGE))[:, None]  # the Quest page's keys up to the token
        x = tl.load(K + page * s_kp + h * s_kh + (sub * PAGE + t)[:, None] * s_kt + d[None, :], mask=ok,
                    other=0.0).to(tl.float32)  # exact for K's dtypes; min and max of it round back exactly
        at = page * s_bp + h * s_bh + sub * s_bs + d
        tl.store(Lo + at, tl.min(tl.where(ok, x, float("inf")), 0).to(Lo.dtype.element_ty))
        tl.store(Hi + at, tl.max(tl.where(ok, x, float("-inf")), 0).to(Hi.dtype.element_ty))

    @triton.jit
    def _scores_kernel(Q, Lo, Hi, Out, pages, g, stride_qh, stride_qg, stride_qm, stride_bh, stride_bp,
                       stride_oh, stride_om, BLOCK_P: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
        pb = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        mi = tl.program_id(2).to(tl.int64)
        gi = tl.arange(0, G_PAD)
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + h * stride_qh + gi[:, None] * stride_qg + mi * stride_qm + d[None, :],
                    mask=(gi < g)[:, None], other=0.0).to(tl.float32)
        pg = pb * BLOCK_P + tl.arange(0, BLOCK_P)
        p_ok = pg < pages
        off = h * stride_bh + pg.to(tl.int64)[:, None] * stride_bp + d[None, :]
        hi = tl.load(Hi + off, mask=p_ok[:, None], other=0.0).to(tl.float32)
        lo = tl.load(Lo + off, mask=p_ok[:, None], other=0.0).to(tl.float32)
        ub = tl.dot(tl.maximum(q, 0.0), tl.trans(hi), input_precision="ieee")
        ub = tl.dot(tl.minimum(q, 0.0), tl.trans(lo), ub, input_precision="ieee")  # [G_PAD, BLOCK_P]
        ub = tl.max(tl.where((gi < g)[:, None], ub, float("-inf")), 0)
        tl.store(Out + h * stride_oh + mi * stride_om + pg, ub, mask=p_ok)


def _head_dim_ok(d: int) -> None:
    if d < 16 or d & (d - 1):
        raise ValueError(f"the Quest kernels need a power-of-two head dim >= 16, got {d}")


def page_bounds(k: torch.Tensor, page: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """k [h_kv, n, d] -> element-wise (min, max) per page, two [h_kv, ceil(n / page), d] in k's dtype
    (or written into ``out``, e.g. the pages being extended in a larger bounds buffer)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    h_kv, n, d = k.shape
    _head_dim_ok(d)
    if page < 1 or page & (page - 1):
        raise ValueError(f"page size must be a power of two, got {page}")
    k = k if k.stride(-1) == 1 else k.contiguous()
    pages = -(-n // page)
    if out is None:
        lo = torch.empty(h_kv, pages, d, dtype=k.dtype, device=k.device)
        hi = torch.empty_like(lo)
    else:
        lo, hi = out
        if lo.stride() != hi.stride() or lo.stride(-1) != 1:
            raise ValueError("the bounds buffers need one set of strides and a contiguous last dim")
    per = max(1, _PAGES * 16 // page)  # tiles of at least 128 rows
    if pages and h_kv:
        _bounds_kernel[(-(-pages // per), h_kv)](k, lo, hi, n, pages, k.stride(0), k.stride(1), lo.stride(0),
                                                 lo.stride(1), PAGE=page, PAGES=per, HEAD_DIM=d, num_warps=4)
    return lo, hi


def update_page_bounds(k: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, pages: torch.Tensor,
                       offsets: torch.Tensor, page: int) -> None:
    """Recomputes in place ``lo, hi [num_pages + 1, h_kv, S, d]`` (K's dtype, unit last stride) for the Quest page
    of ``page`` tokens that each listed token lies in, from the paged keys ``k [num_pages, h_kv, page_size, d]``
    (unit last stride) up to that token: token i is cache page ``pages[i]``, slot ``offsets[i]`` (device int
    tensors [M]). Two tokens of one Quest page in one call are a race: list each page's last token only."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    _, h_kv, size, d = k.shape
    _head_dim_ok(d)
    if (page < 1 or page & (page - 1) or size % page or lo.shape[1:] != (h_kv, size // page, d)
            or lo.stride() != hi.stride() or lo.shape != hi.shape or lo.dtype != k.dtype or hi.dtype != k.dtype
            or lo.stride(-1) != 1 or k.stride(-1) != 1 or pages.shape != offsets.shape or pages.dim() != 1):
        raise ValueError("update_page_bounds needs k [pages, h_kv, page_size, d] and bounds [pages + 1, h_kv, "
                         "page_size / page, d] of K's dtype with unit last strides, a power-of-two page dividing "
                         "the cache page, and pages / offsets [M]")
    if pages.numel() and h_kv:
        _update_kernel[(pages.numel(), h_kv)](k, lo, hi, pages, offsets, k.stride(0), k.stride(1), k.stride(2),
                                              lo.stride(0), lo.stride(1), lo.stride(2), PAGE=page,
                                              PP=max(16, page), HEAD_DIM=d, num_warps=4)


def page_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [h_kv, g, m, d], bounds [h_kv, P, d] -> fp32 [h_kv, m, P], the group's max of the page upper bound."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    h_kv, g, m, d = q.shape
    _head_dim_ok(d)
    pages = lo.shape[1]
    if lo.shape != hi.shape or lo.shape[0] != h_kv or lo.shape[2] != d:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, bounds {tuple(lo.shape)} / {tuple(hi.shape)}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    if lo.stride() != hi.stride() or lo.stride(-1) != 1:  # the kernel addresses both with one set of strides
        lo, hi = lo.contiguous(), hi.contiguous()
    out = torch.empty(h_kv, m, pages, dtype=torch.float32, device=q.device) if out is None else out
    if pages and m and h_kv:
        _scores_kernel[(-(-pages // _BLOCK_P), h_kv, m)](
            q, lo, hi, out, pages, g, q.stride(0), q.stride(1), q.stride(2), lo.stride(0), lo.stride(1),
            out.stride(0), out.stride(1), BLOCK_P=_BLOCK_P, G_PAD=max(16, next_pow2(g)), HEAD_DIM=d, num_warps=4)
    return out
