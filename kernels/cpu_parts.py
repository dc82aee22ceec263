"""Sketch&Walk's paired part decode on CPUs (``sketch_walk_parts``, ``decode_unit="part"``): C kernels for its
sketches, its part scores with the heads' partial combine, and its part list.

The PyTorch forms run a sparse layer of a decode step as ~70 operators (the SRHT's butterflies, the state's
gather and scatter, the part means, an einsum, the fp64 combine, the keys, a top-k and a sort), each a few
microseconds of dispatch on tensors of a few hundred kilobytes. Here they are three calls (``native``), with the
interfaces of the Triton kernels they stand in for (``sketch_scorer.decode_sketches``,
``part_scores.part_combine``, ``part_select.part_select``), on PyTorch's own OpenMP threads:

- ``decode_sketches``: each KV head's query-group mean (summed in head order, then divided by the group, as
  ``mean`` does) and its new key, padded, signed, through the butterflies in ``fwht``'s order, divided by
  sqrt(d') and scaled: ``scorer_reference.srht_reference``'s operations, so the sketches are its bits.
- ``part_combine``: the new key's sketch into its part (stored when it is the part's first token, else added;
  every row's new sums taken from the state before any is stored, as the PyTorch form's gather then scatter),
  then per part and query sketch the dot product with the part's sum, divided by the part's count and by
  sqrt(r), and the partial combine in fp64 (the sum of exp(score) for "pair-lse", of the score for "pair", in
  head order; 0 and -inf for an empty part). The dot product is summed in its own order and divided once
  (``part_scores_reference`` divides the sums first and lets the einsum pick its order), so a score can differ
  from it by fp32 rounding, as the Triton kernel's does.
- ``part_select``: ``_combine_heads``' finalisation ("pair" divided by the head count, "pair-lse" clamped and
  its log taken, then fp32) and ``PartsDecode._choose_parts``' list: every filled part of the sink and local
  blocks and the top min(budget - forced, top, candidates) other filled parts by (score, lower part), the budget
  round-half-even(fp32 density x blocks), at least 1, times P; ascending, -1 padded to ``out_width``
  (``cpu_topk``'s selection, no sort). On the same scores the lists are the PyTorch form's bit for bit, ties
  included.

``supported`` says where they serve (fp32 CPU tensors, the library built); elsewhere the callers keep the
PyTorch forms.
"""

from __future__ import annotations

import ctypes
import math

import torch

from . import cpu_topk, native

_SOURCE = cpu_topk.SOURCE + native.VEC8 + r"""
#include <float.h>
#include <stdlib.h>


/* srht_reference of one row x [d] (y: scratch [dp]): pad, signs, fwht's butterflies, / root, coords, * scale */
static void srht_row(const float *x, int64_t d, float *y, int64_t dp, const float *signs, const int64_t *coords,
                     int64_t r, float root, float scale, float *out) {
    for (int64_t i = 0; i < dp; i++) y[i] = (i < d ? x[i] : 0.0f) * signs[i];
    for (int64_t hh = 1; hh < dp; hh *= 2)
        for (int64_t s0 = 0; s0 < dp; s0 += 2 * hh)
            for (int64_t i = s0; i < s0 + hh; i++) {
                float a = y[i], b = y[i + hh];
                y[i] = a + b;
                y[i + hh] = a - b;
            }
    for (int64_t c = 0; c < r; c++) out[c] = (y[coords[c]] / root) * scale;
}

/* q [bsz, h, d]; kp [pages, h_kv, page, d]; the new keys at (spages[b], soffs[b]); out [2, bsz, h_kv, r]. */
int decode_sketches_f32(const float *q, const float *kp, const int64_t *spages, const int64_t *soffs,
                        const float *signs, const int64_t *coords, int64_t bsz, int64_t h, int64_t h_kv,
                        int64_t page, int64_t d, int64_t dp, int64_t r, float root, float scale, float *out) {
    int64_t g = h / h_kv;
    float *y = (float *)malloc(sizeof(float) * (dp + d));
    if (!y) return -1;
    float *x = y + dp;
    for (int64_t b = 0; b < bsz; b++)
        for (int64_t j = 0; j < h_kv; j++) {
            const float *qg = q + (b * h + j * g) * d;
            for (int64_t e = 0; e < d; e++) {
                float s = qg[e];
                for (int64_t gi = 1; gi < g; gi++) s += qg[gi * d + e];
                x[e] = s / (float)g;
            }
            srht_row(x, d, y, dp, signs, coords, r, root, scale, out + (b * h_kv + j) * r);
            const float *kr = kp + ((spages[b] * h_kv + j) * page + soffs[b]) * d;
            srht_row(kr, d, y, dp, signs, coords, r, root, scale, out + ((bsz + b) * h_kv + j) * r);
        }
    free(y);
    return 0;
}

/* Four dot products of r elements as independent vector sums (one sum's chain of dependent adds would bound
   the loop by their latency). */
static void dots4(const float *const *qv, const float *const *kv, int64_t r, float *res) {
    if (r % 8 == 0) {
        v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t x = 0; x < r; x += 8) {
            a0 += ld8(qv[0] + x) * ld8(kv[0] + x);
            a1 += ld8(qv[1] + x) * ld8(kv[1] + x);
            a2 += ld8(qv[2] + x) * ld8(kv[2] + x);
            a3 += ld8(qv[3] + x) * ld8(kv[3] + x);
        }
        res[0] = hsum8(a0); res[1] = hsum8(a1); res[2] = hsum8(a2); res[3] = hsum8(a3);
        return;
    }
    for (int i = 0; i < 4; i++) {
        float s = 0.0f;
        for (int64_t x = 0; x < r; x++) s += qv[i][x] * kv[i][x];
        res[i] = s;
    }
}

/* ks [rows, h_kv, r] (one layer's part sums, updated); table [bsz, tstride] (W pages); n [bsz]; qs [bsz, h_kv * G, r];
   kn [bsz, h_kv, r]; out [bsz, W * P] fp64. Returns 0, or -1 where scratch could not be had. */
int part_combine_f32(float *ks, const int32_t *table, int64_t tstride, int64_t W, const int64_t *n, const float *qs,
                     const float *kn, int64_t bsz, int64_t h_kv, int64_t G, int64_t r, int64_t size, int64_t P,
                     int lse, float root, double *out, int threads) {
    int64_t hr = h_kv * r, wp = W * P, nq = h_kv * G;
    float *tmp = (float *)malloc(sizeof(float) * (bsz * hr + r));
    int64_t *dst = (int64_t *)malloc(sizeof(int64_t) * (bsz > 0 ? bsz : 1));
    if (!tmp || !dst) { free(tmp); free(dst); return -1; }
    float *zero = tmp + bsz * hr;  /* the query of a padded dot */
    for (int64_t x = 0; x < r; x++) zero[x] = 0.0f;
    for (int64_t b = 0; b < bsz; b++) {
        int64_t cur = (n[b] - 1) / size;
        dst[b] = (int64_t)table[b * tstride + cur / P] * P + cur % P;
        int fresh = (n[b] - 1) % size == 0;
        for (int64_t x = 0; x < hr; x++) tmp[b * hr + x] = (fresh ? 0.0f : ks[dst[b] * hr + x]) + kn[b * hr + x];
    }
    for (int64_t b = 0; b < bsz; b++) memcpy(ks + dst[b] * hr, tmp + b * hr, sizeof(float) * hr);
    int64_t tile = 64, tiles = (wp + tile - 1) / tile;
    #pragma omp parallel for schedule(static) num_threads(threads) if (bsz * tiles > 2)
    for (int64_t it = 0; it < bsz * tiles; it++) {
        int64_t b = it / tiles, c0 = it % tiles * tile, c1 = c0 + tile < wp ? c0 + tile : wp;
        int64_t nn = n[b], held = (nn + size - 1) / size;
        const float *qb = qs + b * nq * r;
        for (int64_t c = c0; c < c1; c++) {
            if (c >= held) { out[b * wp + c] = lse ? 0.0 : -INFINITY; continue; }  /* exp(-inf) summed: 0 */
            const float *row = ks + ((int64_t)table[b * tstride + c / P] * P + c % P) * hr;
            if (c % P == 0 && c / P + PF < W && (c / P + PF) * P < held) {
                /* the part sums PF pages ahead (pages are scattered, past the hardware prefetcher's reach) */
                const char *nx = (const char *)(ks + (int64_t)table[b * tstride + c / P + PF] * P * hr);
                for (int64_t o = 0; o < (int64_t)sizeof(float) * P * hr; o += 64) __builtin_prefetch(nx + o);
            }
            int64_t left = nn - c * size;
            float cnt = (float)(left < 1 ? 1 : left > size ? size : left);
            double acc = 0.0;
            for (int64_t t0 = 0; t0 < nq; t0 += 4) {
                const float *qv[4], *kv[4];
                for (int i = 0; i < 4; i++) {
                    int64_t t = t0 + i < nq ? t0 + i : nq - 1;
                    qv[i] = t0 + i < nq ? qb + t * r : zero;
                    kv[i] = row + t / G * r;
                }
                float s[4];
                dots4(qv, kv, r, s);
                for (int i = 0; i < 4 && t0 + i < nq; i++) {
                    double v = (double)((s[i] / cnt) / root);
                    acc += lse ? exp(v) : v;
                }
            }
            out[b * wp + c] = acc;
        }
    }
    free(tmp);
    free(dst);
    return 0;
}

/* x [bsz, wp] fp64 (the reduced partial); n [bsz]; out [bsz, width]. Returns 0, or -1 where scratch could not be
   had. */
int part_select_f64(const double *x, const int64_t *n, int64_t bsz, int64_t wp, int lse, double heads,
                    int64_t size, int64_t P, int64_t local, float density, int64_t top, int64_t width, int32_t *out,
                    int threads) {
    int bad = 0;
    #pragma omp parallel for schedule(static) num_threads(threads) if (bsz * wp > 8192)
    for (int64_t b = 0; b < bsz; b++) {
        float *sc = (float *)malloc(sizeof(float) * (wp > 0 ? wp : 1));
        uint64_t *keys = (uint64_t *)malloc(sizeof(uint64_t) * (wp > 0 ? wp : 1));
        if (!sc || !keys) { bad = 1; free(sc); free(keys); continue; }
        int64_t nn = n[b], held = (nn + size - 1) / size, nb = (nn + size * P - 1) / (size * P);
        int64_t held_w = held < wp ? held : wp, forced = 0, nc = 0;
        for (int64_t c = 0; c < held_w; c++) {
            double v = x[b * wp + c];
            if (lse) v = log(v < DBL_MIN ? DBL_MIN : v);  /* NaN passes the clamp, as clamp's does */
            else v = v / heads;
            sc[c] = (float)v;
            int64_t blk = c / P;
            if (blk == 0 || blk >= nb - local) forced++;
            else keys[nc++] = rs_key(sc[c], c);
        }
        int64_t budget = (int64_t)rintf(density * (float)nb);
        budget = (budget < 1 ? 1 : budget) * P;
        int64_t k = budget - forced;
        if (k > top) k = top;
        if (k > nc) k = nc;
        uint64_t t = k > 0 ? rs_kth(keys, nc, k) : 0;
        int32_t *o = out + b * width;
        int64_t w = 0;
        for (int64_t c = 0; c < held_w && w < width; c++) {
            int64_t blk = c / P;
            if (blk == 0 || blk >= nb - local || (k > 0 && rs_key(sc[c], c) >= t)) o[w++] = (int32_t)c;
        }
        for (; w < width; w++) o[w] = -1;
        free(sc);
        free(keys);
    }
    return bad ? -1 : 0;
}
"""

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "decode_sketches_f32": ([_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _f32,
                             _ptr], _int),
    "part_combine_f32": ([_ptr, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _int, _f32,
                          _ptr, _int], _int),
    "part_select_f64": ([_ptr, _ptr, _i64, _i64, _int, ctypes.c_double, _i64, _i64, _i64, _f32, _i64, _i64, _ptr,
                         _int], _int),
}


def library() -> ctypes.CDLL | None:
    """The kernels' library, built once a process (None: no compiler; the PyTorch forms serve)."""
    return native.load("cpu_parts", _SOURCE, _SIGNATURES)


def supported(*tensors: torch.Tensor) -> bool:
    """Whether the kernels serve a call over these tensors: fp32 CPU tensors outside autograd, with the library
    built."""
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 and not t.requires_grad for t in tensors)
            and library() is not None)


def decode_sketches(q: torch.Tensor, k_pages: torch.Tensor, slot_pages: torch.Tensor, slot_offsets: torch.Tensor,
                    signs: torch.Tensor, coords: torch.Tensor, scale: float) -> torch.Tensor:
    """``scorer_dispatch.decode_sketches``: fp32 [2, bsz, h_kv, r], the SRHT (``signs`` [d'], ``coords`` [r],
    ``scale``) of each KV head's query-group mean (q [bsz, h, d]) and of its new key, read at
    ``k_pages[slot_pages, :, slot_offsets]``. Call where ``supported``."""
    lib = library()
    assert lib is not None
    bsz, h, d = q.shape
    _, h_kv, page, dk = k_pages.shape
    dp, r = signs.numel(), coords.numel()
    if dk != d or h % h_kv or dp < d:
        raise ValueError(f"decode_sketches: shapes do not fit: q {tuple(q.shape)}, k {tuple(k_pages.shape)}")
    q, k_pages = q.contiguous(), k_pages.contiguous()
    pages, offs = slot_pages.to(torch.int64).contiguous(), slot_offsets.to(torch.int64).contiguous()
    signs, coords = signs.float().contiguous(), coords.to(torch.int64).contiguous()
    out = torch.empty(2, bsz, h_kv, r, dtype=torch.float32)
    if bsz and lib.decode_sketches_f32(q.data_ptr(), k_pages.data_ptr(), pages.data_ptr(), offs.data_ptr(),
                                       signs.data_ptr(), coords.data_ptr(), bsz, h, h_kv, page, d, dp, r,
                                       math.sqrt(dp), scale, out.data_ptr()) != 0:
        raise MemoryError("decode_sketches: no scratch memory")
    return out


def part_combine(ks: torch.Tensor, table: torch.Tensor, n: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 size: int, parts: int, heads: str) -> torch.Tensor:
    """``part_scores.part_combine``: writes the new key sketches ``k`` [bsz, h_kv, r] into each row's current part
    of ``ks`` [(num_pages + 1) * P, h_kv, r] (a contiguous layer of the state) and returns the heads' partial
    combine [bsz, w * P] fp64 of the query sketches ``q`` [bsz, h_kv * G, r] against every part of the rows'
    pages ``table`` [bsz, w]. Call where ``supported``."""
    if heads not in ("pair", "pair-lse"):
        raise ValueError(f"part_combine combines heads 'pair' or 'pair-lse', got {heads!r}")
    lib = library()
    assert lib is not None
    bsz, hq, r = q.shape
    h_kv = k.shape[1]
    if (not ks.is_contiguous() or ks.shape[1:] != k.shape[1:] or ks.shape[0] % parts or hq % h_kv
            or table.shape[0] != bsz or n.shape != (bsz,)):
        raise ValueError("part_combine needs ks [pages * P, h_kv, r] contiguous, k [bsz, h_kv, r], q [bsz, h_kv * G, "
                         "r], a page table [bsz, w] and lengths [bsz]")
    table = table.to(torch.int32)
    table = table if table.stride(-1) == 1 else table.contiguous()
    n = n.to(torch.int64).contiguous()
    q, k = q.float().contiguous(), k.float().contiguous()
    width = table.shape[1] * parts
    out = torch.empty(bsz, width, dtype=torch.float64)
    if bsz and lib.part_combine_f32(ks.data_ptr(), table.data_ptr(), table.stride(0), table.shape[1], n.data_ptr(),
                                    q.data_ptr(), k.data_ptr(), bsz, h_kv, hq // h_kv, r, size, parts,
                                    int(heads == "pair-lse"), math.sqrt(r), out.data_ptr(),
                                    torch.get_num_threads()) != 0:
        raise MemoryError("part_combine: no scratch memory")
    return out


def part_select(x: torch.Tensor, n: torch.Tensor, heads: str, num_heads: int, block: int, parts: int,
                local_blocks: int, density: float, top: int, out_width: int) -> torch.Tensor:
    """``part_select.part_select``: x [bsz, w * P] fp64, the heads' reduced partial; n [bsz] lengths; ``num_heads``
    the divisor of "pair"; ``top`` the static top width (``p_k``), ``out_width`` the list width (``p_width``).
    Returns the ascending, -1 padded part lists [bsz, out_width] int32. Call where ``library()`` is not None."""
    if heads not in ("pair", "pair-lse"):
        raise ValueError(f"part_select combines heads 'pair' or 'pair-lse', got {heads!r}")
    lib = library()
    assert lib is not None
    bsz, width = x.shape
    if (x.dtype != torch.float64 or n.shape != (bsz,) or block % parts or width % parts
            or not 1 <= out_width <= width or top < 0 or num_heads < 1):
        raise ValueError("part_select needs x [bsz, w * P] fp64, lengths [bsz], P dividing the block and the width, "
                         "1 <= out_width <= width")
    x, n = x.contiguous(), n.to(torch.int64).contiguous()
    out = torch.empty(bsz, out_width, dtype=torch.int32)
    if bsz and lib.part_select_f64(x.data_ptr(), n.data_ptr(), bsz, width, int(heads == "pair-lse"),
                                   float(num_heads), block // parts, parts, local_blocks, density, top, out_width,
                                   out.data_ptr(), torch.get_num_threads()) != 0:
        raise MemoryError("part_select: no scratch memory")
    return out
