"""Block-sparse causal flash-attention forward for ragged prefill, with native GQA.

Inputs (see ``formats``): packed ``q [T, h, d]`` with ``cu_seqlens_q``, a ``PagedKV`` (page size = block
size) or ``PackedKV`` source, and a ``PackedBlockSelection`` (``pack_block_selections`` builds one from
per-sequence ``BlockSelection``s). Sequence i's rows are the last ``q_len`` of its ``n`` keys and its packed
query block r is the absolute block ``q_start // B + r``, as in ``BlockSelection``.

One program handles one query block of one KV head and ``BLOCK_QT`` of its query tokens for all g heads of
the group at once, a ``[BLOCK_QT * g, d]`` tile whose row m is token ``m // g``, head ``m % g`` (the g heads
of a token are adjacent in q, so the tile load is contiguous). K and V blocks are loaded once per tile and
never repeated per head. Key blocks below the diagonal run unmasked; only the entries at or above the
query block (the diagonal, normally one) pay for the causal and end-of-sequence masks. Scores are
pre-multiplied by ``scale * log2(e)`` so the online softmax uses exp2; lse is returned in natural log.
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
from .formats import PackedBlockSelection, pack_block_selections  # noqa: F401 - re-exported

_CNT_CHUNK = 128  # selection entries counted per step


if triton is not None:

    @triton.jit
    def _prefill_kernel(Q, K, V, Out, LSE, IDX, QB_SEQ, QB_START, CU_Q, SEQ_K, CU_K, PT,
                        stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
                        stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                        stride_ih, stride_iq, stride_pt, total_qblocks, max_sel, qk_scale,
                        G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                        BLOCK_QT: tl.constexpr, PAGED: tl.constexpr, PREC: tl.constexpr,
                        CNT_CHUNK: tl.constexpr):
        TILES: tl.constexpr = BLOCK // BLOCK_QT
        ROWS: tl.constexpr = BLOCK_QT * G_PAD
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        # Late query blocks carry the most key blocks: launch them first so they do not form the tail.
        qbi = total_qblocks - 1 - pid // TILES
        tile = pid % TILES
        seq = tl.load(QB_SEQ + qbi)
        r = qbi - tl.load(QB_START + seq)
        q0 = tl.load(CU_Q + seq)
        q_len = tl.load(CU_Q + seq + 1) - q0
        n = tl.load(SEQ_K + seq)
        q_start = n - q_len
        qb = q_start // BLOCK + r  # absolute query block

        m = tl.arange(0, ROWS)
        qpos = qb * BLOCK + tile * BLOCK_QT + m // G_PAD
        hj = m % G_PAD
        row_ok = (qpos >= q_start) & (qpos < n) & (hj < G)
        head = kvh * G + hj
        tok = q0 + qpos - q_start
        q = tl.load(Q + group_tile_offsets(tok, head, stride_qt, stride_qh, HEAD_DIM), mask=row_ok[:, None], other=0.0)

        # Entries are ascending and padded at the end: the valid ones are a prefix, and those below the
        # query block (no mask needed) a prefix of that.
        idx_row = IDX + kvh.to(tl.int64) * stride_ih + qbi.to(tl.int64) * stride_iq
        n_valid = tl.zeros((), dtype=tl.int32)
        n_full = tl.zeros((), dtype=tl.int32)
        for c in range(0, max_sel, CNT_CHUNK):
            e_off = c + tl.arange(0, CNT_CHUNK)
            e = tl.load(idx_row + e_off, mask=e_off < max_sel, other=-1)
            n_valid += tl.sum((e >= 0).to(tl.int32))
            n_full += tl.sum(((e >= 0) & (e < qb)).to(tl.int32))

        pt_row = seq.to(tl.int64) * stride_pt
        kn = tl.arange(0, BLOCK)
        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
        for j in range(0, n_full):
            kb = tl.load(idx_row + j)
            k_base = kv_block_offset(PT, pt_row, CU_K, seq, kb, kvh, stride_kb, stride_kh, stride_kt, BLOCK, PAGED)
            v_base = kv_block_offset(PT, pt_row, CU_K, seq, kb, kvh, stride_vb, stride_vh, stride_vt, BLOCK, PAGED)
            m_i, l_i, acc = attend_block(q, K, V, k_base, v_base, stride_kt, stride_vt, m_i, l_i, acc, qk_scale,
                                         qpos, kb * BLOCK + kn, n, BLOCK, HEAD_DIM, False, PREC)
        for j in range(n_full, n_valid):
            kb = tl.load(idx_row + j)
            kpos = kb * BLOCK + kn
            kb = tl.minimum(kb, (n - 1) // BLOCK)  # a stray block past the end is fully masked: stay in bounds
            k_base = kv_block_offset(PT, pt_row, CU_K, seq, kb, kvh, stride_kb, stride_kh, stride_kt, BLOCK, PAGED)
            v_base = kv_block_offset(PT, pt_row, CU_K, seq, kb, kvh, stride_vb, stride_vh, stride_vt, BLOCK, PAGED)
            m_i, l_i, acc = attend_block(q, K, V, k_base, v_base, stride_kt, stride_vt, m_i, l_i, acc, qk_scale,
                                         qpos, kpos, n, BLOCK, HEAD_DIM, True, PREC)

        # Rows with no causal key selected: zeros and lse = -inf, like the reference.
        out, lse2 = finish_rows(acc, m_i, l_i)
        tl.store(Out + group_tile_offsets(tok, head, stride_ot, stride_oh, HEAD_DIM), out.to(Out.dtype.element_ty),
                 mask=row_ok[:, None])
        lse_off = tok.to(tl.int64) * stride_lt + head.to(tl.int64) * stride_lh
        tl.store(LSE + lse_off, lse2 * 0.6931471805599453, mask=row_ok)

    # (query tokens per tile as rows = tokens * g, num_warps, num_stages); the tile's row count decides
    # register pressure, so configs are given in rows and converted per GQA group size.
    _CONFIGS = [(64, 4, 3), (64, 4, 4), (128, 8, 2), (128, 8, 3), (128, 8, 4), (128, 8, 5)]
    _tuned: dict[tuple[int, int], object] = {}

    def _kernel_for(g_pad: int, block: int):
        key = (g_pad, block)
        if key not in _tuned:
            configs = []
            for rows, warps, stages in _CONFIGS:
                qt = min(block, max(1, rows // g_pad))
                configs.append(triton.Config({"BLOCK_QT": qt}, num_warps=warps, num_stages=stages))
            uniq = {(c.kwargs["BLOCK_QT"], c.num_warps, c.num_stages): c for c in configs}
            _tuned[key] = triton.autotune(list(uniq.values()), key=["G", "HEAD_DIM", "PAGED"])(_prefill_kernel)
        return _tuned[key]


def block_sparse_prefill(q: torch.Tensor, kv: KVSource, sel: PackedBlockSelection, cu_seqlens_q: torch.Tensor,
                         scale: float | None = None, block_qt: int | None = None, out: torch.Tensor | None = None,
                         lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged block-sparse causal attention. q: [T, h, d]; returns out [T, h, d] (q's dtype), lse [T, h] fp32.

    ``out``/``lse`` may be given (preallocated buffers, e.g. views into a larger output); ``block_qt`` pins
    the query tokens per tile and skips autotuning (the interpreter uses one tile per query block).
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    T, h, d = q.shape
    a = kv_args(kv)
    check_head_dim(d)
    b = sel.block_size
    if h % a.h_kv or a.d != d:
        raise ValueError(f"q heads {h} / dim {d} do not fit K/V with {a.h_kv} heads of dim {a.d}")
    if b < 16 or b & (b - 1) or (a.paged and a.page_size != b):
        raise ValueError(f"block size {b} must be a power of two >= 16 and equal the page size")
    if q.stride(-1) != 1:
        q = q.contiguous()
    g = h // a.h_kv
    g_pad = next_pow2(g)
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(T, h, dtype=torch.float32, device=q.device) if lse is None else lse
    idx = sel.indices
    if idx.dtype != torch.int32 or idx.stride(-1) != 1:
        idx = idx.to(torch.int32).contiguous()
    total_qb, max_sel = idx.shape[1], idx.shape[2]
    if total_qb == 0 or T == 0:
        return out, lse
    args = (q, a.k, a.v, out, lse, idx, sel.qblock_seq.to(torch.int32), sel.qblock_start.to(torch.int32),
            cu_seqlens_q.to(torch.int32),
            a.seqlens, a.cu_k, a.page_table, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            lse.stride(0), lse.stride(1), *a.k_strides, *a.v_strides, idx.stride(0), idx.stride(1), a.pt_stride,
            total_qb, max_sel, scale * LOG2E)
    meta = dict(G=g, G_PAD=g_pad, HEAD_DIM=d, BLOCK=b, PAGED=a.paged, PREC=dot_precision(q.dtype),
                CNT_CHUNK=_CNT_CHUNK)
    if block_qt is None and interpreting():
        block_qt = b  # one program per query block: the interpreter pays per program
    if block_qt is not None:
        grid = (total_qb * (b // block_qt), a.h_kv)
        _prefill_kernel[grid](*args, BLOCK_QT=block_qt, **meta, num_warps=4, num_stages=3)
    else:
        def grid(meta_: dict) -> tuple[int, int]:
            return (total_qb * (b // meta_["BLOCK_QT"]), a.h_kv)

        _kernel_for(g_pad, b)[grid](*args, **meta)
    return out, lse
