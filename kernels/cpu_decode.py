"""Decode attention over a selection of the paged cache on CPUs: a small C kernel, built on first use.

One query row per sequence over a list of entries per KV head (``indices`` [B, h_kv, W], -1 padded; pages,
parts of pages or tokens: every page for dense decode, a method's selection for the sparse ones), read in
place through the page table: no gather, no copy of K or V. Work items are (sequence, KV head, span of the
list), or (sequence, span) with every head where the heads share one list, and run on PyTorch's own OpenMP
threads (``native``); each item keeps an online softmax of its group's query heads over its entries, and
the items of a row are merged by their log-sum-exp. The PyTorch
forms (``paged_torch``) stay the fallback where no C compiler is found, and ``paged_decode_fp32`` is the
oracle the tests hold it to.

Why C: PyTorch's paths run a decode row as GEMMs with 9 output columns (oneDNN and MKL both reach about a
third of the memory bandwidth there) plus a dozen operators a layer; reading K and V once at the memory's
rate is what a decode step's attention costs, and a plain loop compiled for the host's vector width does it.
"""

from __future__ import annotations

import ctypes
import math

import torch

from . import native
from .formats import PagedKV

_SOURCE = native.VEC_EXP + r"""
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define G_MAX 16
#define PAGE_MAX 256

/* One page of one KV head for its group's g query heads: the scores, the online softmax's running max m and
   sum l, the unnormalised weighted values a [g, D]. D is a constant in the specialised copies, so a row of
   K or V stays in vector registers. */
#define PAGE_STEP(D)                                                                                          \
    for (int64_t t = 0; t < t_n; t++) {                                                                       \
        const float *kr = kp + t * (D);                                                                       \
        for (int64_t gi = 0; gi < g; gi++) {                                                                  \
            const float *qg = q + gi * (D);                                                                   \
            float dot = 0.0f;                                                                                 \
            _Pragma("omp simd reduction(+:dot)")                                                              \
            for (int64_t x = 0; x < (D); x++) dot += qg[x] * kr[x];                                           \
            s[gi * PAGE_MAX + t] = dot * scale;                                                               \
        }                                                                                                     \
    }                                                                                                         \
    for (int64_t gi = 0; gi < g; gi++) {                                                                      \
        float *sg = s + gi * PAGE_MAX, *ag = a + gi * (D);                                                    \
        float mx = m[gi];                                                                                     \
        for (int64_t t = 0; t < t_n; t++) mx = sg[t] > mx ? sg[t] : mx;                                       \
        float corr = rs_expf(m[gi] - mx), sum = 0.0f;                                                            \
        _Pragma("omp simd reduction(+:sum)")                                                                  \
        for (int64_t t = 0; t < t_n; t++) { sg[t] = rs_expf(sg[t] - mx); sum += sg[t]; }                         \
        l[gi] = l[gi] * corr + sum;                                                                           \
        m[gi] = mx;                                                                                           \
        float r[(D)];                                                                                         \
        for (int64_t x = 0; x < (D); x++) r[x] = ag[x] * corr;                                                \
        for (int64_t t = 0; t < t_n; t++) {                                                                   \
            const float *vr = vp + t * (D);                                                                   \
            float w = sg[t];                                                                                  \
            _Pragma("omp simd")                                                                               \
            for (int64_t x = 0; x < (D); x++) r[x] += w * vr[x];                                              \
        }                                                                                                     \
        for (int64_t x = 0; x < (D); x++) ag[x] = r[x];                                                       \
    }

/* One item: row b's list entries [e0, e1) (units of ``unit`` keys, a page or a part of one) for KV heads
   [j0, j1), entry by entry and, within an entry, head by head, so that a dense row reads each page's
   [h_kv, page, D] block of K and V once, in order. The entry after next is prefetched while this one is
   attended (a page's blocks lie past the hardware prefetcher's reach; two ahead measured faster than one,
   and both than none).
   m, l, a are [h_kv, g], [h_kv, g], [h_kv, g, D]. */
#define ITEM(NAME, D)                                                                                         \
static void NAME(const float *qrow, const float *k, const float *v, const int32_t *table, const int32_t *list, \
                 int64_t lstride, int64_t e0, int64_t e1, int64_t j0, int64_t j1, int64_t n, int64_t h_kv,       \
                 int64_t page, int64_t unit, int64_t d, int64_t g, float scale, float *m0, float *l0,            \
                 float *a0) {                                                                                  \
    float s[G_MAX * PAGE_MAX];                                                                                \
    (void)d;                                                                                                  \
    for (int64_t e = e0; e < e1; e++) {                                                                       \
        for (int64_t j = j0; j < j1; j++) {                                                                   \
            int64_t lp = list[j * lstride + e];                                                               \
            if (lp < 0) continue;                                                                             \
            int64_t tok = lp * unit, t_n = n - tok;                                                           \
            if (t_n <= 0) continue;                                                                           \
            if (t_n > unit) t_n = unit;                                                                       \
            int64_t row = (table[tok / page] * h_kv + j) * page + tok % page;                                 \
            const float *kp = k + row * (D), *vp = v + row * (D);                                             \
            if (j == j1 - 1 && e + 2 < e1) {                                                                  \
                for (int64_t jn = j0; jn < j1; jn++) {                                                        \
                    int64_t ln = list[jn * lstride + e + 2];                                                  \
                    if (ln < 0) continue;                                                                     \
                    int64_t tn = ln * unit;                                                                   \
                    int64_t rn = (table[tn / page] * h_kv + jn) * page + tn % page;                           \
                    const char *kn = (const char *)(k + rn * (D)), *vn = (const char *)(v + rn * (D));        \
                    for (int64_t o = 0; o < unit * (D) * 4; o += 64) {                                        \
                        __builtin_prefetch(kn + o); __builtin_prefetch(vn + o);                               \
                    }                                                                                         \
                }                                                                                             \
            }                                                                                                 \
            const float *q = qrow + j * g * (D);                                                              \
            float *m = m0 + j * g, *l = l0 + j * g, *a = a0 + j * g * (D);                                    \
            PAGE_STEP(D)                                                                                      \
        }                                                                                                     \
    }                                                                                                         \
}

ITEM(item_64, 64)
ITEM(item_128, 128)
ITEM(item_any, d)

/* q [B, h, d]; k, v [pages, h_kv, page, d]; table [B, table_stride] physical pages; indices [B, h_kv, W]
   entries of ``unit`` keys each (a divisor of the page; -1: none); lens [B]; shared: every head's list is
   head 0's (a dense row), so an item takes all heads of a span of pages. Work items: (row, span of ``span``
   entries[, head]). Writes out [B, h, d] and lse [B, h] of the rows with a key (others are left as the
   caller set them). Returns 0, or -1 where scratch could not be had. */
int paged_decode_f32(const float *q, const float *k, const float *v, const int32_t *table, int64_t table_stride,
                     const int32_t *indices, int64_t width, const int32_t *lens, int64_t B, int64_t h, int64_t h_kv,
                     int64_t page, int64_t unit, int64_t d, float scale, int64_t span, int shared, float *out,
                     float *lse, int threads) {
    int64_t g = h / h_kv;
    int64_t spans = (width + span - 1) / span;
    int64_t groups = shared ? 1 : h_kv;
    int64_t items = B * spans * groups;
    /* per (row, span): m, l [h], a [h, d] */
    int64_t stride = h * (d + 2);
    float *part = (float *)malloc(sizeof(float) * B * spans * stride);
    if (!part) return -1;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t it = 0; it < items; it++) {
        int64_t b = it / (spans * groups), sp = (it / groups) % spans, jg = it % groups;
        int64_t j0 = shared ? 0 : jg, j1 = shared ? h_kv : jg + 1;
        int64_t e0 = sp * span, e1 = e0 + span < width ? e0 + span : width;
        float *p = part + (b * spans + sp) * stride;
        float *m = p, *l = p + h, *a = p + 2 * h;
        for (int64_t x = j0 * g; x < j1 * g; x++) { m[x] = -FLT_MAX; l[x] = 0.0f; }
        memset(a + j0 * g * d, 0, sizeof(float) * (j1 - j0) * g * d);
        const int32_t *list = indices + b * h_kv * width;
        int64_t lstride = shared ? 0 : width;
        const float *qrow = q + b * h * d;
        if (d == 64)
            item_64(qrow, k, v, table + b * table_stride, list, lstride, e0, e1, j0, j1, lens[b], h_kv, page, unit,
                    d, g, scale, m, l, a);
        else if (d == 128)
            item_128(qrow, k, v, table + b * table_stride, list, lstride, e0, e1, j0, j1, lens[b], h_kv, page, unit,
                     d, g, scale, m, l, a);
        else
            item_any(qrow, k, v, table + b * table_stride, list, lstride, e0, e1, j0, j1, lens[b], h_kv, page, unit,
                     d, g, scale, m, l, a);
    }
    for (int64_t b = 0; b < B; b++) {
        for (int64_t x = 0; x < h; x++) {
            float mm = -FLT_MAX;
            for (int64_t sp = 0; sp < spans; sp++) {
                float *p = part + (b * spans + sp) * stride;
                if (p[h + x] > 0.0f && p[x] > mm) mm = p[x];
            }
            if (mm == -FLT_MAX) continue;
            float ll = 0.0f;
            float *o = out + (b * h + x) * d;
            for (int64_t y = 0; y < d; y++) o[y] = 0.0f;
            for (int64_t sp = 0; sp < spans; sp++) {
                float *p = part + (b * spans + sp) * stride;
                if (p[h + x] <= 0.0f) continue;
                float w = rs_expf(p[x] - mm);
                ll += p[h + x] * w;
                float *ax = p + 2 * h + x * d;
                for (int64_t y = 0; y < d; y++) o[y] += w * ax[y];
            }
            for (int64_t y = 0; y < d; y++) o[y] /= ll;
            lse[b * h + x] = mm + logf(ll);
        }
    }
    free(part);
    return 0;
}
"""

_SPAN_KEYS = 1024  # keys of list entries an item takes: a 4K dense row is 4 items
_G_MAX, _PAGE_MAX = 16, 256
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {"paged_decode_f32": ([_ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64,
                                     ctypes.c_float, _i64, ctypes.c_int, _ptr, _ptr, ctypes.c_int], ctypes.c_int)}


def library() -> ctypes.CDLL | None:
    """The kernel's library, built once a process (None: no compiler; the PyTorch forms serve)."""
    return native.load("cpu_decode", _SOURCE, _SIGNATURES)


def supported(q: torch.Tensor, kv: PagedKV, unit: int | None = None) -> bool:
    """Whether the kernel serves this call: CPU fp32 tensors, a group of at most 16 query heads, pages of at
    most 256 keys, list entries of ``unit`` keys dividing the page (None: a page), no autograd, and the
    library built."""
    h_kv, page = kv.k.shape[1], kv.k.shape[2]
    unit = page if unit is None else unit
    return (q.device.type == "cpu" and q.dtype == kv.k.dtype == kv.v.dtype == torch.float32
            and 0 < unit <= page and page % unit == 0
            and q.shape[1] % h_kv == 0 and q.shape[1] // h_kv <= _G_MAX and page <= _PAGE_MAX
            and not (torch.is_grad_enabled() and q.requires_grad) and library() is not None)


def paged_pages_decode(q: torch.Tensor, kv: PagedKV, indices: torch.Tensor, scale: float | None = None,
                       shared: bool = False, unit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, h, d] (each row's newest position) over the keys of its listed entries, ``indices`` [B, h_kv, W]
    (-1: none) of ``unit`` keys each (None: whole pages; tokens with 1), keys past the row's length masked;
    ``shared``: every KV head's list is the first's (dense decode), so a work item reads all heads of its
    pages in memory order. Returns out [B, h, d] and lse [B, h]
    (fp32, natural log); a row with no key gets zeros and -inf. Call where ``supported``."""
    lib = library()
    assert lib is not None
    b, h, d = q.shape
    h_kv, page = kv.k.shape[1], kv.k.shape[2]
    unit = page if unit is None else unit
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    q = q.contiguous()
    k, v = kv.k.contiguous(), kv.v.contiguous()
    table = kv.page_table.to(torch.int32).contiguous()
    idx = indices.to(torch.int32).contiguous()
    lens = kv.seqlens.to(torch.int32).contiguous()
    out = torch.zeros_like(q)
    lse = torch.full((b, h), -math.inf, dtype=torch.float32)
    if b and idx.shape[-1]:
        rc = lib.paged_decode_f32(q.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(), table.stride(0),
                                  idx.data_ptr(), idx.shape[-1], lens.data_ptr(), b, h, h_kv, page,
                                  unit, d, scale, max(1, _SPAN_KEYS // unit),
                                  int(shared), out.data_ptr(), lse.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise MemoryError("paged decode: no memory for the items' partial results")
    return out, lse
