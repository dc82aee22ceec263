"""The CPU's list selection in C: the forced entries and the kk best candidates of a score row, ascending.

``SOURCE`` is the C the CPU's selection kernels share (``cpu_quest``, ``cpu_parts`` compile it into their own
libraries): ``rs_key``, a candidate's 64-bit key (the fp32 score's order-preserving bits, -0.0 as 0.0, then the
reversed column, so keys are distinct and ties go to the lower column, as a stable descending sort ranks them),
and ``rs_kth``, the k-th largest of n keys by quickselect (average O(n), no sort). A row's picks are then the
candidates whose key is at least that one, listed in column order: nothing is sorted.

``select_list`` is ``row_select.select_list``'s contract over this C (+inf forced, -inf excluded, any finite
value a candidate, kk clamped to [0, k_max] and to the row's candidates, -1 padded): the tests hold it to
``row_select.select_list_torch`` bit for bit, ties included, and the kernels built on ``SOURCE`` inherit that.
"""

from __future__ import annotations

import ctypes

import torch

from . import native

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A candidate's key: the larger key is the better candidate (the higher score, then the lower column).
   -0.0 keys as 0.0; NaN bits order as the reference's int32 keys do. */
static inline uint64_t rs_key(float s, int64_t col) {
    if (s == 0.0f) s = 0.0f;
    uint32_t b;
    memcpy(&b, &s, 4);
    b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((uint64_t)b << 32) | (uint64_t)(0xFFFFFFFFu - (uint32_t)col);
}

static inline uint64_t rs_median3(uint64_t x, uint64_t y, uint64_t z) {
    if (x > y) { uint64_t t = x; x = y; y = t; }
    if (y > z) y = z;
    return x > y ? x : y;
}

/* The k-th largest (1 <= k <= n) of n distinct keys; reorders a. */
static uint64_t rs_kth(uint64_t *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1;  /* its index in descending order */
    while (lo < hi) {
        uint64_t piv = rs_median3(a[lo], a[lo + (hi - lo) / 2], a[hi]);
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] > piv) i++;
            while (a[j] < piv) j--;
            if (i <= j) { uint64_t t = a[i]; a[i] = a[j]; a[j] = t; i++; j--; }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return a[want];
    }
    return a[want];
}

/* One row's list: the columns of s [n] whose keys are among its k best finite ones (k clamped to [0, k_max]) or
   whose score is +inf (forced), ascending, in o [width], -1 after. Returns -1 where scratch could not be had. */
static int rs_select_row(const float *s, int64_t n, int64_t kr, int64_t k_max, int64_t width, int32_t *o) {
    uint64_t *keys = (uint64_t *)malloc(sizeof(uint64_t) * (n > 0 ? n : 1));
    if (!keys) return -1;
    int64_t nc = 0;
    for (int64_t c = 0; c < n; c++)
        if (isfinite(s[c])) keys[nc++] = rs_key(s[c], c);
    int64_t k = kr < 0 ? 0 : kr;
    if (k > k_max) k = k_max;
    if (k > nc) k = nc;
    uint64_t t = k > 0 ? rs_kth(keys, nc, k) : 0;
    int64_t w = 0;
    for (int64_t c = 0; c < n && w < width; c++)
        if (s[c] == INFINITY || (k > 0 && isfinite(s[c]) && rs_key(s[c], c) >= t)) o[w++] = (int32_t)c;
    for (; w < width; w++) o[w] = -1;
    free(keys);
    return 0;
}
"""

_LIST = SOURCE + r"""
#include <stdlib.h>

/* score [R, n]; kk [R]; out [R, width]. Returns 0, or -1 where scratch could not be had. */
int select_list_f32(const float *score, const int64_t *kk, int64_t R, int64_t n, int64_t k_max, int64_t width,
                    int32_t *out, int threads) {
    int bad = 0;
    #pragma omp parallel for schedule(static) num_threads(threads) if (R > 1)
    for (int64_t r = 0; r < R; r++)
        if (rs_select_row(score + r * n, n, kk[r], k_max, width, out + r * width)) bad = 1;
    return bad ? -1 : 0;
}
"""

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {"select_list_f32": ([_ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, ctypes.c_int], ctypes.c_int)}


def library() -> ctypes.CDLL | None:
    """The list selection's library, built once a process (None: no compiler)."""
    return native.load("cpu_topk", _LIST, _SIGNATURES)


def select_list(score: torch.Tensor, kk: torch.Tensor, k_max: int, out_width: int) -> torch.Tensor:
    """``row_select.select_list`` in C: score fp32 [R, N] on the CPU, kk [R] -> int32 [R, out_width]. Call where
    ``library()`` is not None."""
    lib = library()
    assert lib is not None
    score = score.contiguous()
    kk = kk.to(torch.int64).contiguous()
    rows, n = score.shape
    out = torch.empty(rows, out_width, dtype=torch.int32)
    if rows and out_width:
        if lib.select_list_f32(score.data_ptr(), kk.data_ptr(), rows, n, k_max, out_width, out.data_ptr(),
                               torch.get_num_threads()) != 0:
            raise MemoryError("select_list: no memory for a row's keys")
    return out
