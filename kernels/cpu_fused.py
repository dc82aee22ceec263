"""The decoder layer's fused elementwise ops on CPUs (fp32): a small C kernel each (``native``), with the
interface of the Triton ones (``fused_ops``), so ``raysparse.layers.fused_ops`` hands either to the layer.

Each op reads its inputs once and writes its outputs once, where PyTorch's forms run several operators a call
(RMSNorm five, RoPE six per tensor, SiLU * up two): at a prefill chunk's sizes that is memory traffic, at a
decode step's it is per-operator dispatch. The products and sums are those of the PyTorch code, in fp32, the
order of a row's sum of squares aside; its tests hold them to it.
"""

from __future__ import annotations

import ctypes

import torch

from . import native

_SOURCE = native.VEC_EXP + r"""
#include <math.h>
#include <stdint.h>

/* rows of x (row stride xs) [+ residual r (rs)] -> h = x + r (when has_res; contiguous), out = w * norm(h) */
void rms_norm_f32(const float *x, int64_t xs, const float *r, int64_t rs, const float *w, float *out, float *h,
                  int64_t rows, int64_t n, float eps, int has_res, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows > 8)
    for (int64_t i = 0; i < rows; i++) {
        const float *xi = x + i * xs;
        float *hi = has_res ? h + i * n : (float *)xi;
        if (has_res) {
            const float *ri = r + i * rs;
            #pragma omp simd
            for (int64_t c = 0; c < n; c++) hi[c] = ri[c] + xi[c];
        }
        float ss = 0.0f;
        #pragma omp simd reduction(+:ss)
        for (int64_t c = 0; c < n; c++) ss += hi[c] * hi[c];
        float inv = 1.0f / sqrtf(ss / (float)n + eps);
        float *oi = out + i * n;
        #pragma omp simd
        for (int64_t c = 0; c < n; c++) oi[c] = w[c] * (hi[c] * inv);
    }
}

/* RoPE (rotate-half) of q [t, hq, d] and k [t, hk, d] (row strides qs, ks; heads d apart) with cos/sin [t, d];
   the rotated q to qo [t, hq, d]; the rotated k and v [t, hk, d] (row stride vs) to the caches
   [pages, hk, page, d] at (pages[i], offs[i]). */
void rope_cache_f32(const float *q, int64_t qs, const float *k, int64_t ks, const float *v, int64_t vs,
                    const float *cs, const float *sn, float *qo, float *kc, float *vc, const int64_t *pages,
                    const int64_t *offs, int64_t t, int64_t hq, int64_t hk, int64_t d, int64_t page, int threads) {
    int64_t half = d / 2;
    #pragma omp parallel for schedule(static) num_threads(threads) if (t > 8)
    for (int64_t i = 0; i < t; i++) {
        const float *c = cs + i * d, *s = sn + i * d;
        for (int64_t hh = 0; hh < hq + hk; hh++) {
            const float *x = hh < hq ? q + i * qs + hh * d : k + i * ks + (hh - hq) * d;
            float *o = hh < hq ? qo + (i * hq + hh) * d : kc + ((pages[i] * hk + hh - hq) * page + offs[i]) * d;
            #pragma omp simd
            for (int64_t e = 0; e < half; e++) {
                float a1 = x[e], a2 = x[e + half];
                o[e] = a1 * c[e] - a2 * s[e];
                o[e + half] = a2 * c[e + half] + a1 * s[e + half];
            }
        }
        for (int64_t hh = 0; hh < hk; hh++) {
            const float *x = v + i * vs + hh * d;
            float *o = vc + ((pages[i] * hk + hh) * page + offs[i]) * d;
            for (int64_t e = 0; e < d; e++) o[e] = x[e];
        }
    }
}

/* out [rows, n] = silu(gate) * up, gate and up rows strided (gs, us) */
void silu_mul_f32(const float *g, int64_t gs, const float *u, int64_t us, float *out, int64_t rows, int64_t n,
                  int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (rows > 8)
    for (int64_t i = 0; i < rows; i++) {
        const float *gi = g + i * gs, *ui = u + i * us;
        float *oi = out + i * n;
        #pragma omp simd
        for (int64_t c = 0; c < n; c++) oi[c] = gi[c] / (1.0f + rs_expf(-gi[c])) * ui[c];
    }
}
"""
_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "rms_norm_f32": ([_ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, ctypes.c_float, _int, _int], None),
    "rope_cache_f32": ([_ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64,
                        _i64, _i64, _i64, _int], None),
    "silu_mul_f32": ([_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _int], None),
}


def _lib() -> ctypes.CDLL | None:
    return native.load("cpu_fused", _SOURCE, _SIGNATURES)


def available(x: torch.Tensor) -> bool:
    """Whether these ops serve ``x``'s layer: an fp32 CPU tensor outside autograd, and the library built."""
    return (x.device.type == "cpu" and x.dtype == torch.float32
            and not (torch.is_grad_enabled() and x.requires_grad) and _lib() is not None)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, n] with dense rows (a strided row stride is read in place)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    w = weight.float().contiguous()
    out = torch.empty(x2.shape[0], n, dtype=torch.float32)
    h = torch.empty_like(out) if residual is not None else x2
    _lib().rms_norm_f32(x2.data_ptr(), x2.stride(0), r2.data_ptr(), r2.stride(0), w.data_ptr(), out.data_ptr(),
                        h.data_ptr(), x2.shape[0], n, eps, int(residual is not None), torch.get_num_threads())
    return out.view(*x.shape[:-1], n), h.view(*x.shape[:-1], n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm.forward`` of an fp32 x [..., n] (the weight fp32 too)."""
    if weight.dtype != torch.float32:
        raise ValueError("the CPU's fused norm takes an fp32 weight")
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h), h) for h = residual + x (fp32, one shape): the residual add and the next norm."""
    if x.dtype != residual.dtype or x.shape != residual.shape or weight.dtype != torch.float32:
        raise ValueError(f"x and residual must match and the weight be fp32: {x.dtype} {tuple(x.shape)} vs "
                         f"{residual.dtype} {tuple(residual.shape)}")
    return _norm(x, residual, weight, eps)


def rope_and_cache_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_pages: torch.Tensor,
                         slot_offsets: torch.Tensor) -> torch.Tensor:
    """``fused_ops.rope_and_cache_write`` for fp32: RoPE of q [T, hq, d] and k [T, hk, d] with cos/sin [T, d],
    the rotated k and v [T, hk, d] written to k_cache / v_cache [pages, hk, page_size, d] at (slot_pages,
    slot_offsets). Returns the rotated q."""
    t, hq, d = q.shape
    hk = k.shape[1]
    if d % 2 or k.shape != (t, hk, d) or v.shape != (t, hk, d) or k_cache.shape[1] != hk or k_cache.shape[-1] != d:
        raise ValueError("q, k, v and the caches disagree on tokens, KV heads or head dim (or an odd head dim)")
    if not (q.dtype == k.dtype == v.dtype == cos.dtype == sin.dtype == k_cache.dtype == torch.float32):
        raise ValueError("the CPU's fused RoPE takes fp32 q, k, v, cos, sin and caches")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the caches must be contiguous")
    # heads must lie d apart within a token's row (views of one merged q/k/v GEMM output do)
    q, k, v = (x if x.stride(-1) == 1 and x.stride(-2) == d else x.contiguous() for x in (q, k, v))
    cos, sin = cos.contiguous(), sin.contiguous()
    pages, offs = slot_pages.to(torch.int64).contiguous(), slot_offsets.to(torch.int64).contiguous()
    qo = torch.empty(t, hq, d, dtype=torch.float32)
    if t:
        _lib().rope_cache_f32(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                              cos.data_ptr(), sin.data_ptr(), qo.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                              pages.data_ptr(), offs.data_ptr(), t, hq, hk, d, k_cache.shape[2],
                              torch.get_num_threads())
    return qo


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for fp32 tensors of one shape; rows may be strided (the halves of one GEMM)."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dtype != torch.float32:
        raise ValueError("gate and up must be fp32 of one shape")
    n = gate.shape[-1]
    g2, u2 = _rows(gate), _rows(up)
    out = torch.empty(g2.shape[0], n, dtype=torch.float32)
    if out.numel():
        _lib().silu_mul_f32(g2.data_ptr(), g2.stride(0), u2.data_ptr(), u2.stride(0), out.data_ptr(), g2.shape[0], n,
                            torch.get_num_threads())
    return out.view(gate.shape)
