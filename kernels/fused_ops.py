"""Triton kernels fusing the decoder layer's small elementwise ops: RMSNorm (with the residual add), RoPE of
q and k together with the paged K/V cache write, and SiLU(gate) * up.

Why: in a graph-replayed decode step every PyTorch elementwise op is its own kernel (RMSNorm alone is seven:
cast, pow, mean, rsqrt, mul, cast, weight mul), about 19 per layer, and their cost does not shrink with
tensor parallelism. Here a layer issues four: ``add_rms_norm`` (the previous MLP's residual add and the
input norm; ``rms_norm`` before the first layer), ``rope_and_cache_write``, ``add_rms_norm`` (the attention's
residual add and the post-attention norm) and ``silu_mul``.

Each kernel reproduces the PyTorch path's roundings (``raysparse.layers``, ``raysparse.rope``,
``KVCache.write``), which stay the oracle: 16-bit elementwise ops are computed in fp32 and rounded to the
model dtype after every op PyTorch rounds after, and the norm runs in fp32 and is cast back before the
weight. Reductions (the norm's mean) and ``exp`` may differ from PyTorch's in the last fp32 bit.

The wrappers allocate their outputs from shapes only and never read device values on the host, so the
decode step stays CUDA-graph capturable. This module imports Triton; ``raysparse.layers`` imports it only
when the fused path is chosen.
"""

from __future__ import annotations

import torch

from .common import next_pow2, tl, triton


@triton.jit
def _rms_norm_kernel(X, R, W, OUT, H, stride_x, stride_r, stride_o, stride_h, n, eps,
                     BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
    """One row: h = round(x + r) (stored) when ``HAS_RES``, else h = x; out = w * round(h * rstd(h))."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:
        r = tl.load(R + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the residual stream's rounding, as ``h + attn``
        tl.store(H + row * stride_h + cols, x, mask=ok)
    norm_row_store(x, W, OUT + row * stride_o, cols, ok, n, eps)


@triton.jit
def norm_row_store(h, W, OUT_ROW, cols, ok, n, eps):
    """RMSNorm of one row h, stored at OUT_ROW: w * round(h * rstd(h)) in fp32, as ``RMSNorm.reference``."""
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / n + eps)  # as torch.rsqrt
    normed = (hf * rstd).to(h.dtype).to(tl.float32)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT_ROW + cols, (w * normed).to(OUT_ROW.dtype.element_ty), mask=ok)


def _row_major(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _norm_launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    x2 = _row_major(x).reshape(-1, n)
    r2 = _row_major(residual).reshape(-1, n) if residual is not None else x2
    # The weight multiply follows PyTorch's type promotion (an fp32 weight on a bf16 model gives fp32).
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    h = torch.empty_like(x2) if residual is not None else x2
    block = next_pow2(n)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, h, x2.stride(0), r2.stride(0), out.stride(0),
                                         h.stride(0), n, eps, BLOCK=block, HAS_RES=residual is not None,
                                         num_warps=min(16, max(1, block // 256)))
    return out.view(*x.shape[:-1], n), h.view(*x.shape[:-1], n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm.forward``: x [..., n] normalised in fp32, cast back to x's dtype, times the weight."""
    return _norm_launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h), h) for h = residual + x in their (common) dtype: the residual add and the next norm."""
    if x.dtype != residual.dtype or x.shape != residual.shape:
        raise ValueError(f"x and residual must match: {x.dtype} {tuple(x.shape)} vs "
                         f"{residual.dtype} {tuple(residual.shape)}")
    return _norm_launch(x, residual, weight, eps)


@triton.jit
def _rotate_store(X, OUT, x_row, o_row, heads, stride_xh, stride_oh, c1, c2, s1, s2,
                  HEADS: tl.constexpr, HALF: tl.constexpr):
    """Rotates ``heads`` head rows of one token (rotate-half) and stores them at OUT + o_row. Each product
    and the sum are rounded to x's dtype, as PyTorch's ``x * cos + rotate_half(x) * sin`` does."""
    hh = tl.arange(0, HEADS)[:, None]
    dd = tl.arange(0, HALF)[None, :]
    ok = hh < heads
    src = X + x_row + hh.to(tl.int64) * stride_xh + dd
    x1 = tl.load(src, mask=ok, other=0.0)
    x2 = tl.load(src + HALF, mask=ok, other=0.0)
    dt = x1.dtype
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    o1 = (a1 * c1).to(dt).to(tl.float32) - (a2 * s1).to(dt).to(tl.float32)
    o2 = (a2 * c2).to(dt).to(tl.float32) + (a1 * s2).to(dt).to(tl.float32)
    dst = OUT + o_row + hh.to(tl.int64) * stride_oh + dd
    tl.store(dst, o1.to(dt).to(OUT.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, o2.to(dt).to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _rope_cache_kernel(Q, K, V, COS, SIN, QO, KC, VC, PAGES, OFFS, hq, hk,
                       sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sqo_t, sqo_h, s_cos, s_sin,
                       skc_p, skc_h, skc_t, svc_p, svc_h, svc_t,
                       HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr):
    """One token: rotated q to QO; rotated k and v into the caches at (page, offset) of its slot."""
    t = tl.program_id(0).to(tl.int64)
    dd = tl.arange(0, HALF)
    # cos / sin are already rounded to the model dtype (``RotaryEmbedding.forward``); both halves are loaded
    # so that the kernel needs nothing of how they were built.
    c1 = tl.load(COS + t * s_cos + dd).to(tl.float32)[None, :]
    c2 = tl.load(COS + t * s_cos + HALF + dd).to(tl.float32)[None, :]
    s1 = tl.load(SIN + t * s_sin + dd).to(tl.float32)[None, :]
    s2 = tl.load(SIN + t * s_sin + HALF + dd).to(tl.float32)[None, :]
    _rotate_store(Q, QO, t * sq_t, t * sqo_t, hq, sq_h, sqo_h, c1, c2, s1, s2, HQ, HALF)
    page = tl.load(PAGES + t).to(tl.int64)
    off = tl.load(OFFS + t).to(tl.int64)
    _rotate_store(K, KC, t * sk_t, page * skc_p + off * skc_t, hk, sk_h, skc_h, c1, c2, s1, s2, HK, HALF)
    hh = tl.arange(0, HK)[:, None]
    ok = hh < hk
    d2 = tl.arange(0, 2 * HALF)[None, :]
    v = tl.load(V + t * sv_t + hh.to(tl.int64) * sv_h + d2, mask=ok, other=0.0)
    tl.store(VC + page * svc_p + off * svc_t + hh.to(tl.int64) * svc_h + d2, v.to(VC.dtype.element_ty), mask=ok)


def rope_and_cache_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_pages: torch.Tensor,
                         slot_offsets: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` on q [T, hq, d] and k [T, hk, d] with cos/sin [T, d], and ``KVCache.write`` of the
    rotated k and of v [T, hk, d] into k_cache / v_cache [pages, hk, page_size, d] at rows
    (slot_pages, slot_offsets), in one launch. Returns the rotated q (q's dtype); the caches keep theirs."""
    t, hq, d = q.shape
    hk = k.shape[1]
    if d % 2 or d & (d - 1):
        raise ValueError(f"the fused RoPE needs a power-of-two head dim, got {d}")
    if k.shape != (t, hk, d) or v.shape != (t, hk, d) or k_cache.shape[1] != hk or k_cache.shape[-1] != d:
        raise ValueError("q, k, v and the caches disagree on tokens, KV heads or head dim")
    if q.dtype != k.dtype or cos.dtype != q.dtype or sin.dtype != q.dtype:
        raise ValueError("q, k, cos and sin must share the model dtype")
    q, k, v, cos, sin = (_row_major(x) for x in (q, k, v, cos, sin))
    qo = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t:
        _rope_cache_kernel[(t,)](
            q, k, v, cos, sin, qo, k_cache, v_cache, slot_pages, slot_offsets, hq, hk,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), qo.stride(0),
            qo.stride(1), cos.stride(0), sin.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            HQ=next_pow2(hq), HK=next_pow2(hk), HALF=d // 2, num_warps=4)
    return qo


@triton.jit
def _silu_mul_kernel(G, U, OUT, n, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(G + row * stride_g + offs, mask=ok, other=0.0)
    u = tl.load(U + row * stride_u + offs, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)  # F.silu rounds before the multiply
    tl.store(OUT + row * stride_o + offs, (act * u.to(tl.float32)).to(OUT.dtype.element_ty), mask=ok)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` for tensors of one shape and dtype. Rows may be strided (gate and up as the two
    halves of one merged GEMM's output), so they are read in place."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError("gate and up must share shape and dtype")
    shape, n = gate.shape, gate.shape[-1]
    g2, u2 = (_row_major(x).reshape(-1, n) for x in (gate, up))
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    block = min(1024, next_pow2(max(n, 16)))
    if out.numel():
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](g2, u2, out, n, g2.stride(0), u2.stride(0),
                                                               out.stride(0), BLOCK=block, num_warps=4)
    return out.view(shape)
