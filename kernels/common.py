"""What the Triton kernels share: interpreter detection, launch-argument plumbing, the jit helpers that
address K/V rows in either KV source (``formats.PagedKV`` / ``formats.PackedKV``) and the attention
kernels' common steps (the group tile's offsets, the online-softmax update over one key block, the
normalising epilogue). Jit helpers are inlined, so folding them here costs the kernels nothing.

Every helper builds its tensors with device ops from shapes only (no host synchronisation), so the
decode path stays CUDA-graph capturable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .formats import KVSource, PagedKV

try:  # Triton is optional: CPU-only installs use the PyTorch reference.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None
    HAS_TRITON = False

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (tests); autotuning is skipped there."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _patch_interpreter_for_numpy24() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and converts them with ``int()``, which
    NumPy >= 2.4 refuses (triton-lang/triton#9171), so every loop with a runtime bound fails there. Re-set
    ``tensor.__index__`` to squeeze first; harmless on versions with the upstream fix."""
    try:
        from triton.runtime import interpreter as interp
    except ImportError:  # pragma: no cover
        return
    orig = getattr(interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_raysparse_patched", False):
        return

    def patched(tensor, scope) -> None:
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._raysparse_patched = True  # type: ignore[attr-defined]
    interp._patch_lang_tensor = patched


if HAS_TRITON and interpreting():
    _patch_interpreter_for_numpy24()


@dataclass(frozen=True)
class KVArgs:
    """Uniform launch arguments of a KV source: pointer, strides [block/page, head, token], metadata."""

    k: torch.Tensor
    v: torch.Tensor
    k_strides: tuple[int, int, int]
    v_strides: tuple[int, int, int]
    page_table: torch.Tensor
    pt_stride: int
    cu_k: torch.Tensor
    seqlens: torch.Tensor
    page_size: int  # 0 for packed sources
    paged: bool
    h_kv: int
    d: int


def kv_args(kv: KVSource) -> KVArgs:
    for t in (kv.k, kv.v):
        if t.stride(-1) != 1:
            raise ValueError("K/V need a contiguous last dimension")
    if isinstance(kv, PagedKV):
        _, h_kv, page, d = kv.k.shape
        ks = (kv.k.stride(0), kv.k.stride(1), kv.k.stride(2))
        vs = (kv.v.stride(0), kv.v.stride(1), kv.v.stride(2))
        pt = kv.page_table.to(torch.int32)
        seqlens = kv.seqlens.to(torch.int32)
        return KVArgs(kv.k, kv.v, ks, vs, pt, pt.stride(0), seqlens, seqlens, page, True, h_kv, d)
    _, h_kv, d = kv.k.shape
    ks = (0, kv.k.stride(1), kv.k.stride(0))
    vs = (0, kv.v.stride(1), kv.v.stride(0))
    cu = kv.cu_seqlens.to(torch.int32)
    seqlens = cu[1:] - cu[:-1]
    return KVArgs(kv.k, kv.v, ks, vs, cu, 0, cu, seqlens, 0, False, h_kv, d)


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def int8_flags(mask: torch.Tensor) -> torch.Tensor:
    """A flag tensor as the int8 a kernel reads: a contiguous bool one as its own bytes (0 or 1, a view, no launch),
    anything else converted."""
    return mask.contiguous().view(torch.int8) if mask.dtype == torch.bool else mask.to(torch.int8)


def check_head_dim(d: int) -> None:
    # tl.arange needs a power of two; tl.dot needs K >= 16.
    if d < 16 or d & (d - 1):
        raise ValueError(f"the Triton kernels need a power-of-two head dim >= 16, got {d}")


def dot_precision(dtype: torch.dtype) -> str:
    """16-bit inputs: tensor cores, exact products. fp32 inputs: TF32 tensor cores on the GPU (about 1e-3
    relative error, like torch matmuls with TF32 allowed; exact fp32 dots spill badly and 3xTF32 tiles
    overflow shared memory), exact fp32 in the interpreter, where the tests compare with the reference."""
    return "ieee" if dtype == torch.float32 and interpreting() else "tf32"


def fp32_value(x: float) -> float:
    """``x`` rounded to fp32, as a Python float: the value PyTorch multiplies an fp32 tensor by."""
    return float(torch.tensor(x, dtype=torch.float32))


if HAS_TRITON:

    @triton.jit
    def kv_row_offsets(PT, pt_row, CU_K, seq, tok, kvh, stride_b, stride_h, stride_t,
                       PAGE: tl.constexpr, PAGED: tl.constexpr):
        """Element offsets (int64) of the K or V rows of tokens ``tok`` of sequence ``seq``, head ``kvh``.

        Paged: token t lives at page ``page_table[seq, t // PAGE]``, row ``t % PAGE``. Packed: row
        ``cu_k[seq] + t``. Callers mask ``tok`` themselves; masked lanes must still hold a valid ``tok``
        (>= 0) so the page-table load stays in bounds.
        """
        if PAGED:
            page = tl.load(PT + pt_row + tok // PAGE).to(tl.int64)
            off = page * stride_b + (tok % PAGE).to(tl.int64) * stride_t
        else:
            base = tl.load(CU_K + seq).to(tl.int64)
            off = (base + tok.to(tl.int64)) * stride_t
        return off + kvh.to(tl.int64) * stride_h

    @triton.jit
    def kv_block_offset(PT, pt_row, CU_K, seq, kb, kvh, stride_b, stride_h, stride_t,
                        BLOCK: tl.constexpr, PAGED: tl.constexpr):
        """Element offset (int64) of token 0 of key block ``kb``; rows follow at ``stride_t``.

        Paged sources need ``page_size == BLOCK`` (one block is one page)."""
        if PAGED:
            off = tl.load(PT + pt_row + kb).to(tl.int64) * stride_b
        else:
            off = (tl.load(CU_K + seq).to(tl.int64) + kb * BLOCK) * stride_t
        return off + kvh.to(tl.int64) * stride_h

    @triton.jit
    def row_budget_units(units, density):
        """``methods.budget.row_budget`` in a kernel: max(1, round-half-even(density * units)) as int32, where
        ``density`` is the fp32 value PyTorch multiplies by (``fp32_value``). The product is exact in fp64 and
        rounded once, as PyTorch's fp32 multiply: an fp32 product the compiler contracted into
        ``t - floor(t)`` (an FMA) would see the unrounded value at a half-way budget."""
        t = (units.to(tl.float64) * density).to(tl.float32)
        f = tl.floor(t)
        d = t - f
        tau = tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, f + (f.to(tl.int32) & 1).to(tl.float32)))
        return tl.maximum(tau.to(tl.int32), 1)

    @triton.jit
    def kth_key(cand, key, kk, ncand):
        """The kk-th largest int32 order key among a row's ``ncand`` candidates (or a key with exactly kk
        candidates at or above it): a bisection in int64 (the keys' range can exceed int32) from the
        candidates' key range, stopping once exactly kk keys lie at or above ``lo`` (no tie straddles it),
        ~log2(candidates) passes on spread scores instead of 32. Non-candidates' keys must be I32_MIN."""
        lo = tl.min(tl.where(cand, key, 2147483647), 0).to(tl.int64)  # count(key >= lo) >= kk
        hi = tl.max(tl.where(cand, key, -2147483648), 0).to(tl.int64)
        c_lo = ncand
        if tl.sum((key >= hi).to(tl.int32), 0) >= kk:  # the largest key alone has enough (or kk == 0)
            lo = hi
            c_lo = kk
        while (hi - lo > 1) & (c_lo != kk):  # count(key >= hi) < kk
            mid = lo + (hi - lo) // 2
            c = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), 0)  # mid lies in int32: compare narrow
            lo = tl.where(c >= kk, mid, lo)
            c_lo = tl.where(c >= kk, c, c_lo)
            hi = tl.where(c >= kk, hi, mid)
        return lo

    @triton.jit
    def take_at_threshold(cand, key, thr, kk, forced):
        """A list selection's last step, given the threshold key ``thr`` of a row's kk-th best candidate:
        the forced entries, every candidate above ``thr`` and the first ties at it in ascending column order
        up to kk picks. Returns the take mask (int32), each taken entry's position in the ascending list and
        how many are taken."""
        gt = cand & (key > thr)
        tie = cand & (key == thr)
        ngt = tl.sum(gt.to(tl.int32), 0)
        pick = (gt | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= kk - ngt))) & (kk > 0)
        take = (forced | pick).to(tl.int32)
        return take, tl.cumsum(take, 0) - 1, tl.sum(take, 0)

    # ---- the attention kernels' shared prologue, inner step and epilogue ----------------------------

    @triton.jit
    def group_tile_offsets(tok, head, stride_t, stride_h, HEAD_DIM: tl.constexpr):
        """Element offsets [ROWS, HEAD_DIM] of a (token, head) row tile of a packed [T, h, d] tensor (q, out)."""
        d = tl.arange(0, HEAD_DIM)
        return tok.to(tl.int64)[:, None] * stride_t + head.to(tl.int64)[:, None] * stride_h + d[None, :]

    @triton.jit
    def softmax_update(s, m_i, l_i, MASKED: tl.constexpr):
        """One online-softmax step on log2-scaled scores s [ROWS, N]: (m_new, l_new, p, alpha).

        ``MASKED`` steps may hold rows with no finite score yet (all -inf): their max is taken as 0 so
        exp2 never sees -inf - -inf; unmasked steps skip that select."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_ref = m_new
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        return m_new, l_i * alpha + tl.sum(p, 1), p, alpha

    @triton.jit
    def attend_rows(q, K, V, k_rows, v_rows, m_i, l_i, acc, qk_scale, qpos, kpos, n,
                    N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr,
                    lo=None, sink=None, WINDOW: tl.constexpr = False):
        """Folds N keys, row i at element offsets ``k_rows[i]`` / ``v_rows[i]`` (one contiguous block or
        several gathered ones), into the running (m_i, l_i, acc) of the query tile q. ``MASKED`` applies the
        causal mask (key ``kpos`` <= query ``qpos``) and the end of the sequence (``kpos < n``); unmasked keys
        lie wholly below every row. ``qk_scale`` (> 0, log2 units) is applied inside the exponent's FMA.

        ``WINDOW`` (masked steps only) adds a per-row window (PSAW): row i keeps only keys below ``sink`` or
        from its ``lo[i]`` up. A compile-time flag, so steps without a window emit no code for it."""
        d = tl.arange(0, HEAD_DIM)
        if MASKED:
            k_ok = kpos < n  # a partial last block: rows past n are not this sequence's keys
            k = tl.load(K + k_rows[:, None] + d[None, :], mask=k_ok[:, None], other=0.0)
            v = tl.load(V + v_rows[:, None] + d[None, :], mask=k_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            if WINDOW:
                seen = (kpos[None, :] < sink) | (kpos[None, :] >= lo[:, None])
                s = tl.where((kpos[None, :] <= qpos[:, None]) & k_ok[None, :] & seen, s, float("-inf"))
            else:
                s = tl.where((kpos[None, :] <= qpos[:, None]) & k_ok[None, :], s, float("-inf"))
            m_i, l_i, p, alpha = softmax_update(s, m_i, l_i, True)
        else:
            # This form masks nothing and its softmax assumes every row has a finite score: a window needs MASKED.
            tl.static_assert(not WINDOW, "a per-row window needs MASKED")
            k = tl.load(K + k_rows[:, None] + d[None, :])
            v = tl.load(V + v_rows[:, None] + d[None, :])
            qk = tl.dot(q, tl.trans(k), input_precision=PREC)
            # max(qk) * scale == max(qk * scale) for scale > 0; exp2(qk * scale - m) is one FMA per score.
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk * qk_scale - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        return m_i, l_i, acc

    @triton.jit
    def attend_block(q, K, V, k_base, v_base, stride_kt, stride_vt, m_i, l_i, acc, qk_scale, qpos, kpos, n,
                     BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr,
                     lo=None, sink=None, WINDOW: tl.constexpr = False):
        """``attend_rows`` over one contiguous key block (rows at ``k_base`` / ``v_base``, ``stride_*t`` apart)."""
        kn = tl.arange(0, BLOCK)
        return attend_rows(q, K, V, k_base + kn * stride_kt, v_base + kn * stride_vt, m_i, l_i, acc, qk_scale,
                           qpos, kpos, n, BLOCK, HEAD_DIM, MASKED, PREC, lo, sink, WINDOW)

    @triton.jit
    def finish_rows(acc, m_i, l_i):
        """(normalised output, log2-sum-exp) per row; a row that attended nothing gets zeros and -inf."""
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        return acc / l_safe[:, None], tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
else:  # pragma: no cover - keeps the kernel modules importable (and their wrappers raising) without triton
    kv_row_offsets = kv_block_offset = group_tile_offsets = softmax_update = row_budget_units = None
    take_at_threshold = kth_key = None
    attend_rows = attend_block = finish_rows = None
