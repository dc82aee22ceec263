"""Quest's batched decode on CPUs: the per-page bounds' update and the page scores with their list, C kernels.

Quest's PyTorch forms run a sparse layer of a decode step as ~60 operators (the bounds' gather, min and max and
scatter; the bounds gathered through the page table, two products, the group's max, the encoding; the list's
keys, top-k and sort), each a few microseconds of dispatch on tensors of a few hundred kilobytes. Here each is
one call (``native``), on PyTorch's own OpenMP threads:

- ``update_bounds``: ``dispatch.update_quest_bounds``'s recomputation, the element-wise min and max of each
  listed token's Quest page over its keys up to the token, tokens in order (a page listed twice ends as the last
  listing leaves it, as the PyTorch form's scatter does). Exact.
- ``decode_lists``: per (row, KV head) the bound ``max_g (q+ . hi + q- . lo)`` of every Quest page of the row read
  through the page table (``paged_quest.paged_quest_scores_torch``'s, with its +inf for the first and current
  page and -inf past the row), then ``row_select.select_list``'s list over it (``cpu_topk``): forced pages and
  the kk best, ascending, -1 padded. The two dot products are summed over d in the loop's order, where
  PyTorch's GEMMs take their own, so a score can differ from the PyTorch form's by fp32 rounding and a list only
  where two pages' scores are that close; on scores both compute exactly (integer bounds and queries) the lists
  are the same bit for bit, ties included.

``supported`` says where they serve (fp32 CPU tensors, the library built); elsewhere the callers keep the
PyTorch forms.
"""

from __future__ import annotations

import ctypes

import torch

from . import cpu_topk, native

_SOURCE = cpu_topk.SOURCE + native.VEC8 + r"""
#include <stdlib.h>


/* k [pages, h_kv, page, d]; lo, hi [pages + 1, h_kv, S, d] (S = page / qpage); tokens m: cache page pages[m],
   slot offs[m]. */
void quest_update_f32(const float *k, float *lo, float *hi, const int64_t *pages, const int64_t *offs, int64_t M,
                      int64_t h_kv, int64_t page, int64_t d, int64_t qpage) {
    int64_t S = page / qpage;
    for (int64_t m = 0; m < M; m++) {
        int64_t pg = pages[m], off = offs[m], sub = off / qpage;
        for (int64_t j = 0; j < h_kv; j++) {
            const float *kr = k + ((pg * h_kv + j) * page + sub * qpage) * d;
            float *l = lo + ((pg * h_kv + j) * S + sub) * d, *h = hi + ((pg * h_kv + j) * S + sub) * d;
            for (int64_t x = 0; x < d; x++) { l[x] = kr[x]; h[x] = kr[x]; }
            for (int64_t t = 1; t <= off - sub * qpage; t++) {
                const float *kt = kr + t * d;
                for (int64_t x = 0; x < d; x++) {  /* NaN propagates, as amin / amax do */
                    float v = kt[x];
                    if (v < l[x] || v != v) l[x] = v;
                    if (v > h[x] || v != v) h[x] = v;
                }
            }
        }
    }
}

/* One Quest page's bound for a group's query heads: q+ . hi + q- . lo of each of the g (of g4, zero-padded) heads,
   their max (NaN propagates, as amax does). */
static float page_bound(const float *qp, const float *qn, const float *hr, const float *lr, int64_t g, int64_t d) {
    float best = -INFINITY;
    for (int64_t g0 = 0; g0 < g; g0 += 4) {
        float ub[4];
        if (d % 8 == 0) {
            /* four heads' sums as eight independent vector accumulators (one sum's chain of dependent adds
               would bound the loop by the adds' latency) */
            v8f P0 = {0}, P1 = {0}, P2 = {0}, P3 = {0}, N0 = {0}, N1 = {0}, N2 = {0}, N3 = {0};
            const float *p0 = qp + g0 * d, *n0 = qn + g0 * d;
            for (int64_t x = 0; x < d; x += 8) {
                v8f hv = ld8(hr + x), lv = ld8(lr + x);
                P0 += ld8(p0 + x) * hv; N0 += ld8(n0 + x) * lv;
                P1 += ld8(p0 + d + x) * hv; N1 += ld8(n0 + d + x) * lv;
                P2 += ld8(p0 + 2 * d + x) * hv; N2 += ld8(n0 + 2 * d + x) * lv;
                P3 += ld8(p0 + 3 * d + x) * hv; N3 += ld8(n0 + 3 * d + x) * lv;
            }
            ub[0] = hsum8(P0 + N0); ub[1] = hsum8(P1 + N1); ub[2] = hsum8(P2 + N2); ub[3] = hsum8(P3 + N3);
        } else {
            for (int64_t i = 0; i < 4; i++) {
                const float *pg = qp + (g0 + i) * d, *ng = qn + (g0 + i) * d;
                float pos = 0.0f, neg = 0.0f;
                for (int64_t x = 0; x < d; x++) { pos += pg[x] * hr[x]; neg += ng[x] * lr[x]; }
                ub[i] = pos + neg;
            }
        }
        for (int64_t i = 0; i < 4 && g0 + i < g; i++)
            if (g0 + i == 0 || ub[i] > best || ub[i] != ub[i]) best = ub[i];
    }
    return best;
}

/* q [B, h, d]; lo, hi [pages + 1, h_kv, S, d]; table [B, tstride] (W pages a row); lens [B]; kk [B * h_kv];
   out [B, h_kv, width]; scores [B, h_kv, W * S], if not NULL, receives the encoded scores. Returns 0, or -1 where
   scratch could not be had. */
int quest_decode_f32(const float *q, const float *lo, const float *hi, const int32_t *table, int64_t tstride,
                     int64_t W, const int32_t *lens, const int64_t *kk, int64_t B, int64_t h, int64_t h_kv,
                     int64_t S, int64_t d, int64_t qpage, int64_t k_max, int64_t width, int32_t *out,
                     float *scores, int threads) {
    int64_t g = h / h_kv, cols = W * S, rows = B * h_kv;
    int64_t g4 = (g + 3) / 4 * 4;  /* query heads in fours, padded with zero rows */
    int64_t block = h_kv * S * d;  /* one cache page's bounds, every KV head */
    float *sc = (float *)malloc(sizeof(float) * (rows * cols + 2 * rows * g4 * d + 1));
    if (!sc) return -1;
    /* every row's q+ and q- rows, once: the page loop is then two dot products a query head */
    float *qpn = sc + rows * cols;
    for (int64_t r = 0; r < rows; r++) {
        const float *qr = q + (r / h_kv * h + r % h_kv * g) * d;
        float *qp = qpn + r * 2 * g4 * d, *qn = qp + g4 * d;
        for (int64_t x = 0; x < g4 * d; x++) {
            float v = x < g * d ? qr[x] : 0.0f;
            qp[x] = v > 0.0f ? v : 0.0f;
            qn[x] = v < 0.0f ? v : 0.0f;
        }
    }
    /* the scores, by (row, cache page): a page's bounds of every KV head lie together, read in memory order,
       the next page's prefetched (pages are scattered, past the hardware prefetcher's reach) */
    #pragma omp parallel for schedule(static) num_threads(threads) if (B * W > 8)
    for (int64_t it = 0; it < B * W; it++) {
        int64_t b = it / W, p = it % W, c0 = p * S;
        int64_t np = ((int64_t)lens[b] + qpage - 1) / qpage;
        if (np > cols) np = cols;
        if (c0 < np && p + PF < W && c0 + PF * S < np) {
            int64_t nx = (int64_t)table[b * tstride + p + PF] * block;
            for (int64_t o = 0; o < block; o += 16) {
                __builtin_prefetch(lo + nx + o);
                __builtin_prefetch(hi + nx + o);
            }
        }
        int64_t at = c0 < np ? (int64_t)table[b * tstride + p] * block : 0;
        for (int64_t j = 0; j < h_kv; j++) {
            const float *qp = qpn + (b * h_kv + j) * 2 * g4 * d;
            float *sr = sc + (b * h_kv + j) * cols;
            for (int64_t s = 0; s < S; s++) {
                int64_t c = c0 + s;
                float v = -INFINITY;  /* past the row's pages */
                if (c < np) v = page_bound(qp, qp + g4 * d, hi + at + (j * S + s) * d, lo + at + (j * S + s) * d, g, d);
                if (c == 0 || c == np - 1) v = INFINITY;  /* forced: the first and the current page */
                sr[c] = v;
            }
        }
    }
    if (scores) memcpy(scores, sc, sizeof(float) * rows * cols);
    /* the lists: cpu_topk's select over each row (a few hundred keys a row are less than a thread's start) */
    int bad = 0;
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows * cols > 8192)
    for (int64_t r = 0; r < rows; r++)
        if (rs_select_row(sc + r * cols, cols, kk[r], k_max, width, out + r * width)) bad = 1;
    free(sc);
    return bad ? -1 : 0;
}
"""

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {
    "quest_update_f32": ([_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64], None),
    "quest_decode_f32": ([_ptr, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64,
                          _i64, _ptr, _ptr, ctypes.c_int], ctypes.c_int),
}


def library() -> ctypes.CDLL | None:
    """The kernels' library, built once a process (None: no compiler; the PyTorch forms serve)."""
    return native.load("cpu_quest", _SOURCE, _SIGNATURES)


def supported(*tensors: torch.Tensor) -> bool:
    """Whether the kernels serve a call over these tensors (the query or keys and the bounds): fp32 CPU tensors
    outside autograd, with the library built."""
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 and not t.requires_grad for t in tensors)
            and library() is not None)


def update_bounds(k: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor,
                  quest_page: int) -> None:
    """``dispatch.update_quest_bounds`` in C: lo, hi [num_pages + 1, h_kv, S, d] (contiguous, updated in place)
    from the paged keys k [num_pages, h_kv, page, d]. Call where ``supported``."""
    lib = library()
    assert lib is not None and lo.is_contiguous() and hi.is_contiguous()
    _, h_kv, page, d = k.shape
    if lo.shape[1:] != (h_kv, page // quest_page, d) or hi.shape != lo.shape or page % quest_page:
        raise ValueError("update_bounds needs bounds [pages + 1, h_kv, page / quest_page, d] for k [pages, h_kv, "
                         "page, d]")
    k = k.contiguous()
    pages, offsets = pages.to(torch.int64).contiguous(), offsets.to(torch.int64).contiguous()
    if pages.numel():
        lib.quest_update_f32(k.data_ptr(), lo.data_ptr(), hi.data_ptr(), pages.data_ptr(), offsets.data_ptr(),
                             pages.numel(), h_kv, page, d, quest_page)


def decode_lists(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, page_table: torch.Tensor,
                 seqlens: torch.Tensor, quest_page: int, kk: torch.Tensor, k_max: int, width: int,
                 scores: torch.Tensor | None = None) -> torch.Tensor:
    """Quest's decode lists [B, h_kv, width] int32: ``paged_quest_scores`` then ``select_list`` over each (row,
    KV head), kk [B * h_kv] candidates each (clamped to [0, k_max]); ``scores`` [B, h_kv, W * S] fp32 contiguous,
    if given, receives the encoded scores ranked. Call where ``supported``."""
    lib = library()
    assert lib is not None
    b, h, d = q.shape
    _, h_kv, sub, _ = lo.shape
    if hi.shape != lo.shape or lo.shape[-1] != d or h % h_kv:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, bounds {tuple(lo.shape)} / {tuple(hi.shape)}")
    q, lo, hi = q.contiguous(), lo.contiguous(), hi.contiguous()
    table = page_table.to(torch.int32)
    table = table if table.stride(-1) == 1 else table.contiguous()
    lens = seqlens.to(torch.int32).contiguous()
    kk = kk.to(torch.int64).contiguous()
    out = torch.empty(b, h_kv, width, dtype=torch.int32)
    if scores is not None and (scores.shape != (b, h_kv, table.shape[1] * sub) or scores.dtype != torch.float32
                               or not scores.is_contiguous()):
        raise ValueError("scores must be [B, h_kv, W * S] fp32 contiguous")
    if b and lib.quest_decode_f32(
            q.data_ptr(), lo.data_ptr(), hi.data_ptr(), table.data_ptr(), table.stride(0), table.shape[1],
            lens.data_ptr(), kk.data_ptr(), b, h, h_kv, sub, d, quest_page, k_max, width, out.data_ptr(),
            None if scores is None else scores.data_ptr(), torch.get_num_threads()) != 0:
        raise MemoryError("quest decode: no memory for a row's scores")
    return out
