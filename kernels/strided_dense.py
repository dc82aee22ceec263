"""Query-strided dense causal attention for Delta: every gamma-th query row against all its causal keys.

For sequence i (query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of the packed ``q [T, h, d]``, the last
``q_len`` of its ``n`` keys, so ``q_start = n - q_len``), the rows are the absolute positions p with
``p % gamma == 0``: local rows ``first, first + gamma, ...`` with ``first = (-q_start) % gamma``, exactly
``q[first::gamma]`` of ``reference.strided_dense_attention``. The outputs of all sequences
are packed along the row axis (``cu_rows``, from ``strided_rows``): out ``[R, h, d]``, lse ``[R, h]``.

One program takes ``BLOCK_QT`` consecutive strided rows of one KV head with all g query heads of the
group as one ``[BLOCK_QT * g, d]`` tile (row m: strided row ``m // g``, head ``m % g``) and sweeps the key
blocks in order; blocks below the tile's first row run unmasked, the rest (up to the last row) masked.
"""

from __future__ import annotations

import math

import torch

from .common import (
    LOG2E,
    KVSource,
    attend_block,
    check_head_dim,
    dot_precision,
    finish_rows,
    group_tile_offsets,
    interpreting,
    kv_args,
    kv_block_offset,
    next_pow2,
    tl,
    triton,
)


def strided_rows(q_lens: list[int], k_lens: list[int], gamma: int) -> list[int]:
    """Strided rows of each sequence (host-side lengths, as in ``BatchMeta``)."""
    rows = []
    for q_len, n in zip(q_lens, k_lens, strict=True):
        first = (q_len - n) % gamma  # = (-q_start) % gamma
        rows.append(max(0, -(-(q_len - first) // gamma)))
    return rows


if triton is not None:

    @triton.jit
    def _strided_kernel(Q, K, V, Out, LSE, CU_Q, SEQ_K, CU_K, CU_R, PT,
                        stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
                        stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_pt,
                        gamma, qk_scale,
                        G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                        BLOCK_QT: tl.constexpr, PAGED: tl.constexpr, PREC: tl.constexpr):
        ROWS: tl.constexpr = BLOCK_QT * G_PAD
        tile = tl.num_programs(0) - 1 - tl.program_id(0)  # late rows have the most keys: run them first
        kvh = tl.program_id(1)
        seq = tl.program_id(2)
        r0 = tl.load(CU_R + seq)
        n_rows = tl.load(CU_R + seq + 1) - r0
        if tile * BLOCK_QT < n_rows:
            q0 = tl.load(CU_Q + seq)
            q_len = tl.load(CU_Q + seq + 1) - q0
            n = tl.load(SEQ_K + seq)
            q_start = n - q_len
            first = (gamma - q_start % gamma) % gamma
            m = tl.arange(0, ROWS)
            j = tile * BLOCK_QT + m // G_PAD
            hj = m % G_PAD
            row_ok = (j < n_rows) & (hj < G)
            head = kvh * G + hj
            qpos = q_start + first + j * gamma
            tok = q0 + first + j * gamma
            q = tl.load(Q + group_tile_offsets(tok, head, stride_qt, stride_qh, HEAD_DIM), mask=row_ok[:, None],
                        other=0.0)
            lo_pos = q_start + first + tile * BLOCK_QT * gamma
            hi_pos = q_start + first + (tl.minimum((tile + 1) * BLOCK_QT, n_rows) - 1) * gamma
            n_full = (lo_pos + 1) // BLOCK  # key blocks entirely at or before the tile's first row
            n_blocks = hi_pos // BLOCK + 1
            pt_row = seq.to(tl.int64) * stride_pt
            kn = tl.arange(0, BLOCK)
            m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([ROWS], dtype=tl.float32)
            acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
            for kb in range(0, n_full):
                k_base = kv_block_offset(PT, pt_row, CU_K, seq, kb, kvh, stride_kb, stride_kh, stride_kt, BLOCK, PAGED)
                v_base = kv_block_offset(PT, pt_row, CU_K, seq, kb, kvh, stride_vb, stride_vh, stride_vt, BLOCK, PAGED)
                m_i, l_i, acc = attend_block(q, K, V, k_base, v_base, stride_kt, stride_vt, m_i, l_i, acc, qk_scale,
                                             qpos, kb * BLOCK + kn, n, BLOCK, HEAD_DIM, False, PREC)
            for kb in range(n_full, n_blocks):
                k_base = kv_block_offset(PT, pt_row, CU_K, seq, kb, kvh, stride_kb, stride_kh, stride_kt, BLOCK, PAGED)
                v_base = kv_block_offset(PT, pt_row, CU_K, seq, kb, kvh, stride_vb, stride_vh, stride_vt, BLOCK, PAGED)
                m_i, l_i, acc = attend_block(q, K, V, k_base, v_base, stride_kt, stride_vt, m_i, l_i, acc, qk_scale,
                                             qpos, kb * BLOCK + kn, n, BLOCK, HEAD_DIM, True, PREC)
            out, lse2 = finish_rows(acc, m_i, l_i)  # every row has key 0, so only padding rows are empty
            orow = r0 + j
            tl.store(Out + group_tile_offsets(orow, head, stride_ot, stride_oh, HEAD_DIM),
                     out.to(Out.dtype.element_ty), mask=row_ok[:, None])
            tl.store(LSE + orow.to(tl.int64) * stride_lt + head.to(tl.int64) * stride_lh, lse2 * 0.6931471805599453,
                     mask=row_ok)

    _CONFIGS = [(64, 4, 3), (128, 8, 2), (128, 8, 3), (128, 8, 4)]  # (tile rows, num_warps, num_stages)
    _tuned: dict[int, object] = {}

    def _kernel_for(g_pad: int):
        if g_pad not in _tuned:
            uniq = {}
            for rows, warps, stages in _CONFIGS:
                qt = max(1, rows // g_pad)
                uniq[(qt, warps, stages)] = triton.Config({"BLOCK_QT": qt}, num_warps=warps, num_stages=stages)
            _tuned[g_pad] = triton.autotune(list(uniq.values()), key=["G", "HEAD_DIM", "PAGED"])(_strided_kernel)
        return _tuned[g_pad]


def strided_dense(q: torch.Tensor, kv: KVSource, cu_seqlens_q: torch.Tensor, gamma: int, q_lens: list[int],
                  k_lens: list[int], scale: float | None = None, block_qt: int | None = None,
                  out: torch.Tensor | None = None, lse: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns out [R, h, d] (q's dtype) and lse [R, h] fp32, rows packed per sequence in order (R =
    ``sum(strided_rows(q_lens, k_lens, gamma))``); ``out``/``lse`` may be preallocated."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    T, h, d = q.shape
    a = kv_args(kv)
    check_head_dim(d)
    if h % a.h_kv or a.d != d or gamma < 1:
        raise ValueError(f"q heads {h} / dim {d} / gamma {gamma} do not fit K/V with {a.h_kv} heads of dim {a.d}")
    block = a.page_size if a.paged else 64
    if block < 16 or block & (block - 1):
        raise ValueError(f"page size {block} must be a power of two >= 16")
    g = h // a.h_kv
    g_pad = next_pow2(g)
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    q = q if q.stride(-1) == 1 else q.contiguous()
    rows = strided_rows(q_lens, k_lens, gamma)
    total, max_rows = sum(rows), max(rows, default=0)
    out = torch.empty(total, h, d, dtype=q.dtype, device=q.device) if out is None else out
    lse = torch.empty(total, h, dtype=torch.float32, device=q.device) if lse is None else lse
    if total == 0:
        return out, lse
    cu_r = torch.tensor([0, *rows], dtype=torch.int64).cumsum(0).to(device=q.device, dtype=torch.int32)
    batch = len(rows)

    args = (q, a.k, a.v, out, lse, cu_seqlens_q.to(torch.int32), a.seqlens, a.cu_k, cu_r, a.page_table,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
            *a.k_strides, *a.v_strides, a.pt_stride, gamma, scale * LOG2E)
    meta = dict(G=g, G_PAD=g_pad, HEAD_DIM=d, BLOCK=block, PAGED=a.paged, PREC=dot_precision(q.dtype))
    if block_qt is None and interpreting():
        block_qt = max(1, 256 // g_pad)
    if block_qt is not None:
        _strided_kernel[(-(-max_rows // block_qt), a.h_kv, batch)](*args, BLOCK_QT=block_qt, **meta,
                                                                   num_warps=4, num_stages=3)
    else:
        _kernel_for(g_pad)[lambda m_: (-(-max_rows // m_["BLOCK_QT"]), a.h_kv, batch)](*args, **meta)
    return out, lse
