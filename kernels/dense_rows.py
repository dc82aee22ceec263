"""Chosen query rows densely over their causal keys, with their "far" part: Delta's dense rows on the paged cache.

Sequence i owns the rows ``cu_rows[i]:cu_rows[i+1]`` (``rows[i]`` of them, host list): row r is query token
``row_tok[r]`` of the packed ``q [T, h, d]`` at absolute position ``row_pos[r]`` of sequence i, and attends
sequence i's keys ``0..row_pos[r]``. Returns, per row and query head, fp32:

- out ``[R, h, d]`` and lse ``[R, h]`` (natural log of the scaled scores), the row's dense attention;
- with ``near`` (bool ``[h_kv, R, NB]``: the key blocks the row's base method attends, NB >= the sequence's
  key blocks), also the attention over the causal keys OUTSIDE those blocks: its out, lse (-inf where there is
  none, out 0 there) and attention-weighted mean key kbar ``[R, h, d]`` (0 where there is none).

``reference.dense_rows_attention`` is the oracle (one sequence over contiguous K/V). One program takes
``BLOCK_QT`` rows of one sequence and KV head with the g query heads of the group as one ``[BLOCK_QT * g, d]``
tile and sweeps the key blocks up to its last row, reading K/V in place (paged: one block is one page).
"""

from __future__ import annotations

import math

import torch

from .common import (
    LOG2E,
    KVSource,
    check_head_dim,
    dot_precision,
    finish_rows,
    group_tile_offsets,
    interpreting,
    kv_args,
    kv_block_offset,
    next_pow2,
    softmax_update,
    tl,
    triton,
)

if triton is not None:

    @triton.jit
    def _rows_kernel(Q, K, V, ROW_TOK, ROW_POS, CU_R, SEQ_K, CU_K, PT, NEAR, Out, LSE, OutF, LSEF, KBar,
                     stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
                     stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt, stride_pt,
                     stride_nh, stride_nr, qk_scale,
                     G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                     BLOCK_QT: tl.constexpr, PAGED: tl.constexpr, FAR: tl.constexpr, PREC: tl.constexpr):
        ROWS: tl.constexpr = BLOCK_QT * G_PAD
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        seq = tl.program_id(2)
        r0 = tl.load(CU_R + seq)
        n_rows = tl.load(CU_R + seq + 1) - r0
        if tile * BLOCK_QT < n_rows:
            n = tl.load(SEQ_K + seq)
            m = tl.arange(0, ROWS)
            j = tile * BLOCK_QT + m // G_PAD
            hj = m % G_PAD
            row_ok = (j < n_rows) & (hj < G)
            r = (r0 + j).to(tl.int64)
            head = kvh * G + hj
            tok = tl.load(ROW_TOK + r, mask=row_ok, other=0)
            qpos = tl.load(ROW_POS + r, mask=row_ok, other=-1)  # padding rows see no key: zeros, -inf
            q = tl.load(Q + group_tile_offsets(tok, head, stride_qt, stride_qh, HEAD_DIM), mask=row_ok[:, None],
                        other=0.0)
            n_blocks = tl.max(qpos, 0) // BLOCK + 1
            pt_row = seq.to(tl.int64) * stride_pt
            kn = tl.arange(0, BLOCK)
            d = tl.arange(0, HEAD_DIM)
            m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([ROWS], dtype=tl.float32)
            acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
            if FAR:
                m_f = tl.full([ROWS], float("-inf"), dtype=tl.float32)
                l_f = tl.zeros([ROWS], dtype=tl.float32)
                acc_f = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
                acc_k = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
            near_row = NEAR + kvh.to(tl.int64) * stride_nh + r * stride_nr
            for kb in range(0, n_blocks):
                k_base = kv_block_offset(PT, pt_row, CU_K, seq, kb, kvh, stride_kb, stride_kh, stride_kt, BLOCK, PAGED)
                v_base = kv_block_offset(PT, pt_row, CU_K, seq, kb, kvh, stride_vb, stride_vh, stride_vt, BLOCK, PAGED)
                kpos = kb * BLOCK + kn
                k_ok = kpos < n
                k = tl.load(K + k_base + kn[:, None] * stride_kt + d[None, :], mask=k_ok[:, None], other=0.0)
                v = tl.load(V + v_base + kn[:, None] * stride_vt + d[None, :], mask=k_ok[:, None], other=0.0)
                s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
                s = tl.where((kpos[None, :] <= qpos[:, None]) & k_ok[None, :], s, float("-inf"))
                m_i, l_i, p, alpha = softmax_update(s, m_i, l_i, True)
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
                if FAR:
                    near = tl.load(near_row + kb, mask=row_ok, other=1) != 0  # [ROWS]: the base attends block kb
                    sf = tl.where(near[:, None], float("-inf"), s)
                    m_f, l_f, pf, af = softmax_update(sf, m_f, l_f, True)
                    acc_f = tl.dot(pf.to(v.dtype), v, acc_f * af[:, None], input_precision=PREC)
                    acc_k = tl.dot(pf.to(k.dtype), k, acc_k * af[:, None], input_precision=PREC)
            out, lse2 = finish_rows(acc, m_i, l_i)
            o_off = group_tile_offsets(r, head, stride_ot, stride_oh, HEAD_DIM)
            l_off = r * stride_lt + head.to(tl.int64) * stride_lh
            tl.store(Out + o_off, out, mask=row_ok[:, None])
            tl.store(LSE + l_off, lse2 * 0.6931471805599453, mask=row_ok)
            if FAR:
                out_f, lse_f2 = finish_rows(acc_f, m_f, l_f)
                kbar, _ = finish_rows(acc_k, m_f, l_f)
                tl.store(OutF + o_off, out_f, mask=row_ok[:, None])
                tl.store(LSEF + l_off, lse_f2 * 0.6931471805599453, mask=row_ok)
                tl.store(KBar + o_off, kbar, mask=row_ok[:, None])


def dense_rows(q: torch.Tensor, kv: KVSource, row_tok: torch.Tensor, row_pos: torch.Tensor, rows: list[int],
               near: torch.Tensor | None = None, scale: float | None = None, block_qt: int | None = None,
               block_size: int = 64) -> tuple[torch.Tensor, ...]:
    """(out, lse), or with ``near`` (out, lse, out_far, lse_far, kbar); every tensor fp32, rows packed per
    sequence in order (see the module docstring). ``near``'s blocks hold ``block_size`` keys: a paged source's
    page size. No host read: ``rows`` is the host's count per sequence."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    T, h, d = q.shape
    a = kv_args(kv)
    check_head_dim(d)
    if h % a.h_kv or a.d != d:
        raise ValueError(f"q heads {h} / dim {d} do not fit K/V with {a.h_kv} heads of dim {a.d}")
    block = a.page_size if a.paged else block_size
    if block < 16 or block & (block - 1):
        raise ValueError(f"page size {block} must be a power of two >= 16")
    if near is not None and block != block_size:
        raise ValueError(f"near's blocks of {block_size} keys must be the cache's pages of {block}")
    total = sum(rows)
    if row_tok.shape != (total,) or row_pos.shape != (total,):
        raise ValueError(f"row_tok / row_pos must hold {total} rows, got {tuple(row_tok.shape)} / "
                         f"{tuple(row_pos.shape)}")
    if near is not None and (near.dim() != 3 or near.shape[:2] != (a.h_kv, total)):
        raise ValueError(f"near must be [{a.h_kv}, {total}, NB], got {tuple(near.shape)}")
    g = h // a.h_kv
    g_pad = next_pow2(g)
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    q = q if q.stride(-1) == 1 else q.contiguous()
    dev = q.device
    res = [torch.empty(total, h, d, device=dev), torch.empty(total, h, device=dev)]
    if near is not None:
        res += [torch.empty(total, h, d, device=dev), torch.empty(total, h, device=dev),
                torch.empty(total, h, d, device=dev)]
    if total == 0:
        return tuple(res)
    near_t = near.to(torch.uint8) if near is not None else torch.zeros(1, 1, 1, dtype=torch.uint8, device=dev)
    out, lse = res[0], res[1]
    out_f, lse_f, kbar = res[2:] if near is not None else (out, lse, out)
    cu_r = torch.tensor([0, *rows], dtype=torch.int64).cumsum(0).to(device=dev, dtype=torch.int32)
    # Four fp32 accumulators with the far part: smaller tiles keep them in registers.
    block_qt = block_qt or max(1, (16 if interpreting() else (32 if near is not None else 64)) // g_pad)
    _rows_kernel[(-(-max(rows) // block_qt), a.h_kv, len(rows))](
        q, a.k, a.v, row_tok.to(torch.int32), row_pos.to(torch.int32), cu_r, a.seqlens, a.cu_k, a.page_table,
        near_t, out, lse, out_f, lse_f, kbar,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        *a.k_strides, *a.v_strides, a.pt_stride, near_t.stride(0), near_t.stride(1), scale * LOG2E,
        G=g, G_PAD=g_pad, HEAD_DIM=d, BLOCK=block, BLOCK_QT=block_qt, PAGED=a.paged, FAR=near is not None,
        PREC=dot_precision(q.dtype), num_warps=4, num_stages=2)
    return tuple(res)
