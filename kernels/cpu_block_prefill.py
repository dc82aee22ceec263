"""Block-sparse causal prefill attention of one sequence on CPUs: a small C kernel (``native``).

A work item is a (query block, KV head) pair: its group's query rows against its listed key blocks, read in
place from K and V (no gather, no mask tensor). Each listed key block is transposed once into a [d, block]
tile held in L1, so the scores of a query row are a broadcast-multiply-add over the tile's columns (no
horizontal sums); then the rows' softmax over their causal keys, and each row's weighted sum of the value
rows. Items run on PyTorch's OpenMP threads. ``paged_torch.block_sparse_prefill_torch`` (a fused masked flash
attention over gathered blocks) stays the fallback, and PSAW's per-row windows keep it.
"""

from __future__ import annotations

import ctypes
import math

import torch

from . import native

_SOURCE = native.VEC_EXP + r"""
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define B_MAX 256
#define MASKED (-1e30f)

/* Item (qi, j): query rows [r0, r1) of query block qi (positions q_start + r), KV head j's listed blocks.
   q [n_q, h, D] rows; k, v rows of head j at k + j * hs. s: scratch [g * rows, S * block]; kt: [D, block]. */
#define ITEM(NAME, D, BLK)                                                                                         \
static void NAME(const float *q, const float *k, const float *v, int64_t hs, const int32_t *list, int64_t S,   \
                 int64_t r0, int64_t r1, int64_t q_start, int64_t n, int64_t h, int64_t j, int64_t g,           \
                 int64_t d, int64_t block, float scale, float *s, float *kt, float *out, float *lse) {          \
    (void)d; (void)block;                                                                                     \
    int64_t rows = r1 - r0, last = q_start + r1 - 1, nb = 0;                                                  \
    int32_t blocks[4096];                                                                                     \
    for (int64_t e = 0; e < S && nb < 4096; e++) {                                                            \
        int64_t kb = list[e];                                                                                 \
        if (kb < 0 || kb * (BLK) >= n || kb * (BLK) > last) continue;                                         \
        blocks[nb++] = (int32_t)kb;                                                                           \
    }                                                                                                         \
    int64_t width = nb * (BLK);                                                                               \
    const float *kj = k + j * hs, *vj = v + j * hs;                                                           \
    for (int64_t bi = 0; bi < nb; bi++) {                                                                     \
        int64_t k0 = (int64_t)blocks[bi] * block, kn = n - k0 < (BLK) ? n - k0 : (BLK);                       \
        for (int64_t x = 0; x < (D); x++)                                                                     \
            for (int64_t c = 0; c < (BLK); c++) kt[x * (BLK) + c] = c < kn ? kj[(k0 + c) * (D) + x] : 0.0f;    \
        for (int64_t gi = 0; gi < g; gi++) {                                                                  \
            for (int64_t r = 0; r < rows; r += 4) {                                                           \
                int64_t rn = rows - r < 4 ? rows - r : 4;                                                     \
                const float *q0 = q + ((r0 + r) * h + j * g + gi) * (D);                                      \
                const float *q1 = rn > 1 ? q0 + h * (D) : q0, *q2 = rn > 2 ? q0 + 2 * h * (D) : q0;           \
                const float *q3 = rn > 3 ? q0 + 3 * h * (D) : q0;                                             \
                float a0[B_MAX], a1[B_MAX], a2[B_MAX], a3[B_MAX];                                             \
                _Pragma("omp simd")                                                                           \
                for (int64_t c = 0; c < (BLK); c++) { a0[c] = 0.0f; a1[c] = 0.0f; a2[c] = 0.0f; a3[c] = 0.0f; } \
                for (int64_t x = 0; x < (D); x++) {                                                           \
                    const float *kx = kt + x * (BLK);                                                         \
                    float x0 = q0[x] * scale, x1 = q1[x] * scale, x2 = q2[x] * scale, x3 = q3[x] * scale;     \
                    _Pragma("omp simd")                                                                       \
                    for (int64_t c = 0; c < (BLK); c++) {                                                     \
                        float kc = kx[c];                                                                     \
                        a0[c] += x0 * kc; a1[c] += x1 * kc; a2[c] += x2 * kc; a3[c] += x3 * kc;               \
                    }                                                                                         \
                }                                                                                             \
                float *accs[4] = {a0, a1, a2, a3};                                                            \
                for (int64_t rr = 0; rr < rn; rr++) {                                                         \
                    int64_t qp = q_start + r0 + r + rr, vis = qp - k0 + 1;                                    \
                    if (vis > kn) vis = kn;                                                                   \
                    float *sr = s + (gi * rows + r + rr) * width + bi * (BLK);                                \
                    const float *acc = accs[rr];                                                              \
                    for (int64_t c = 0; c < (BLK); c++) sr[c] = c < vis ? acc[c] : MASKED;                    \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }                                                                                                         \
    for (int64_t gi = 0; gi < g; gi++) {                                                                      \
        for (int64_t r = 0; r < rows; r++) {                                                                  \
            float *sr = s + (gi * rows + r) * width;                                                          \
            float mx = MASKED, sum = 0.0f;                                                                    \
            for (int64_t c = 0; c < width; c++) mx = sr[c] > mx ? sr[c] : mx;                                 \
            float *o = out + ((r0 + r) * h + j * g + gi) * (D);                                               \
            float *l = lse + (r0 + r) * h + j * g + gi;                                                       \
            if (mx <= MASKED) {                                                                               \
                for (int64_t x = 0; x < (D); x++) o[x] = 0.0f;                                                \
                *l = -FLT_MAX;                                                                                \
                continue;                                                                                     \
            }                                                                                                 \
            _Pragma("omp simd reduction(+:sum)")                                                              \
            for (int64_t c = 0; c < width; c++) { float p = sr[c] <= MASKED ? 0.0f : rs_expf(sr[c] - mx);       \
                                                  sr[c] = p; sum += p; }                                      \
            float acc[(D)];                                                                                   \
            for (int64_t x = 0; x < (D); x++) acc[x] = 0.0f;                                                  \
            for (int64_t bi = 0; bi < nb; bi++) {                                                             \
                int64_t k0 = (int64_t)blocks[bi] * block, kn = n - k0 < (BLK) ? n - k0 : (BLK);               \
                const float *pb = sr + bi * (BLK);                                                            \
                for (int64_t c = 0; c < kn; c++) {                                                            \
                    float p = pb[c];                                                                          \
                    if (p == 0.0f) continue;                                                                  \
                    const float *vr = vj + (k0 + c) * (D);                                                    \
                    _Pragma("omp simd")                                                                       \
                    for (int64_t x = 0; x < (D); x++) acc[x] += p * vr[x];                                    \
                }                                                                                             \
            }                                                                                                 \
            float inv = 1.0f / sum;                                                                           \
            for (int64_t x = 0; x < (D); x++) o[x] = acc[x] * inv;                                            \
            *l = mx + logf(sum);                                                                              \
        }                                                                                                     \
    }                                                                                                         \
}

ITEM(item_64, 64, 64)
ITEM(item_128, 128, 64)
ITEM(item_any, d, block)

/* q [n_q, h, d] (contiguous), the last n_q of the n positions; k, v: head j's rows [n, d] at k + j * hs;
   indices [h_kv, nqb, S] key blocks per (KV head, query block) (-1: none), query block 0 holding position
   q_start. Writes out [n_q, h, d] and lse [n_q, h] (-FLT_MAX for a row with no key). Returns 0, or -1 where
   scratch could not be had. */
int block_sparse_prefill_f32(const float *q, const float *k, const float *v, int64_t hs, const int32_t *indices,
                             int64_t nqb, int64_t S, int64_t n_q, int64_t n, int64_t h, int64_t h_kv, int64_t d,
                             int64_t block, float scale, float *out, float *lse, int threads) {
    int64_t g = h / h_kv, q_start = n - n_q, qb0 = q_start / block;
    int64_t items = nqb * h_kv, fail = 0;
    #pragma omp parallel num_threads(threads)
    {
        float *s = (float *)malloc(sizeof(float) * g * block * (S * block > 0 ? S * block : 1));
        float *kt = (float *)malloc(sizeof(float) * d * block);
        if (!s || !kt) {
            #pragma omp atomic write
            fail = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!s || !kt) continue;
            int64_t qi = it / h_kv, j = it % h_kv;
            int64_t p0 = (qb0 + qi) * block, r0 = p0 - q_start, r1 = r0 + block;
            if (r0 < 0) r0 = 0;
            if (r1 > n_q) r1 = n_q;
            if (r1 <= r0) continue;
            const int32_t *list = indices + (j * nqb + qi) * S;
            if (d == 64 && block == 64)
                item_64(q, k, v, hs, list, S, r0, r1, q_start, n, h, j, g, d, block, scale, s, kt, out, lse);
            else if (d == 128 && block == 64)
                item_128(q, k, v, hs, list, S, r0, r1, q_start, n, h, j, g, d, block, scale, s, kt, out, lse);
            else
                item_any(q, k, v, hs, list, S, r0, r1, q_start, n, h, j, g, d, block, scale, s, kt, out, lse);
        }
        free(s);
        free(kt);
    }
    return fail ? -1 : 0;
}
"""
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {"block_sparse_prefill_f32": ([_ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64,
                                             _i64, ctypes.c_float, _ptr, _ptr, ctypes.c_int], ctypes.c_int)}
_BLOCK_MAX, _LIST_MAX = 256, 4096


def _library() -> ctypes.CDLL | None:
    return native.load("cpu_block_prefill", _SOURCE, _SIGNATURES)


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, block: int) -> bool:
    """Whether the kernel serves this call: CPU fp32 tensors, K and V rows dense per head, blocks of at most
    256 keys, lists of at most 4096 blocks, no autograd, and the library built."""
    return (q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32 and 0 < block <= _BLOCK_MAX
            and indices.shape[-1] <= _LIST_MAX and k.stride(-1) == 1 and k.stride(-2) == k.shape[-1]
            and k.stride() == v.stride() and q.shape[1] % k.shape[0] == 0
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
            and _library() is not None)


def block_sparse_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor, block: int,
                         scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_sparse_prefill_torch``'s contract without a window: q [n_q, h, d], the last n_q of the n keys in
    k, v [h_kv, n, d]; ``indices`` [h_kv, n_qblocks, S]. Returns out [n_q, h, d] and lse [n_q, h] (fp32),
    zeros and -inf for a row that selects no causal key. Call where ``supported``."""
    lib = _library()
    assert lib is not None
    n_q, h, d = q.shape
    h_kv, n = k.shape[0], k.shape[1]
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    q = q.contiguous()
    idx = indices.to(torch.int32).contiguous()
    out = torch.zeros(n_q, h, d, dtype=torch.float32)
    lse = torch.full((n_q, h), -math.inf, dtype=torch.float32)
    if n_q and idx.numel():
        rc = lib.block_sparse_prefill_f32(q.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), idx.data_ptr(),
                                          idx.shape[1], idx.shape[2], n_q, n, h, h_kv, d, block, scale,
                                          out.data_ptr(), lse.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise MemoryError("block-sparse prefill: no memory for the items' scratch")
    return out, lse.masked_fill_(lse <= -torch.finfo(torch.float32).max, -math.inf)
