"""Block-sparse causal flash-attention forward for ragged prefill, with native GQA.

Inputs (see ``formats``): packed ``q [T, h, d]`` with ``cu_seqlens_q``, a ``PagedKV`` (page size = block
size) or ``PackedKV`` source, and a ``PackedBlockSelection`` (``pack_block_selections`` builds one from
per-sequence ``BlockSelection``s). Sequence i's rows are the last ``q_len`` of its ``n`` keys and its packed
query block r is the absolute block ``q_start // B + r``, as in ``BlockSelection``.

One program handles one query block of one KV head and ``BLOCK_QT`` of its query tokens for all g heads of
the group at once, a ``[BLOCK_QT * g, d]`` tile whose row m is token ``m // g``, head ``m % g`` (the g heads
of a token are adjacent in q, so the tile load is contiguous). K and V blocks are loaded once per tile and
never repeated per head. Key blocks below the diagonal run unmasked, ``KB_STEP`` (1 or 2) per step, two
making one gathered 2 * BLOCK key tile; only the entries at or above the query block (the diagonal,
normally one) pay for the causal and end-of-sequence masks; under a per-row window (PSAW) so do the blocks below
the tile's highest bound, and no others (masking every block cost PSAW's windows 26 ms a layer at 32K against
19). The online softmax works in log2 units with ``scale * log2(e)`` folded into exp2's argument; lse is
returned in natural log.

The grid runs the latest (longest) query blocks first, KV head by KV head, so concurrently running
programs share one head's K/V in L2. Tile rows, KB_STEP, warps and pipeline stages are autotuned over
``CONFIGS``, keyed on static things only (group size, head dim, paged or not, dtypes);
``block_sparse_prefill_config`` pins one config instead (sweeps, tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .common import (
    LOG2E,
    KVSource,
    attend_block,
    attend_rows,
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

_CNT_CHUNK = 512  # selection entries counted per step: one step up to 128K tokens at density 0.25


if triton is not None:

    @triton.jit
    def _prefill_kernel(Q, K, V, Out, LSE, IDX, QB_SEQ, QB_START, CU_Q, SEQ_K, CU_K, PT, WLO,
                        stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh,
                        stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                        stride_ih, stride_iq, stride_pt, total_qblocks, max_sel, qk_scale, sink,
                        G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                        BLOCK_QT: tl.constexpr, PAGED: tl.constexpr, PREC: tl.constexpr,
                        CNT_CHUNK: tl.constexpr, KB_STEP: tl.constexpr, WINDOW: tl.constexpr):
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
        # Under a window, the blocks below the tile's highest bound (sinks, the band where windows start) are
        # masked; above it only the causal rule applies. They are a prefix too: n_head entries.
        if WINDOW:
            lo = tl.load(WLO + tok, mask=row_ok, other=0)
            lo_max = tl.max(tl.where(row_ok, lo, 0))
        n_valid = tl.zeros((), dtype=tl.int32)
        n_full = tl.zeros((), dtype=tl.int32)
        n_head = tl.zeros((), dtype=tl.int32)
        for c in range(0, max_sel, CNT_CHUNK):
            e_off = c + tl.arange(0, CNT_CHUNK)
            e = tl.load(idx_row + e_off, mask=e_off < max_sel, other=-1)
            n_valid += tl.sum((e >= 0).to(tl.int32))
            n_full += tl.sum(((e >= 0) & (e < qb)).to(tl.int32))
            if WINDOW:
                n_head += tl.sum(((e >= 0) & (e * BLOCK < lo_max)).to(tl.int32))

        pt_row = seq.to(tl.int64) * stride_pt
        kn = tl.arange(0, BLOCK)
        m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
        if WINDOW:  # the head under the window's mask; the rest below as without a window
            for j in range(0, n_head):
                kb = tl.load(idx_row + j)
                kpos = kb * BLOCK + kn
                kb = tl.minimum(kb, (n - 1) // BLOCK)
                k_base = kv_block_offset(PT, pt_row, CU_K, seq, kb, kvh, stride_kb, stride_kh, stride_kt, BLOCK, PAGED)
                v_base = kv_block_offset(PT, pt_row, CU_K, seq, kb, kvh, stride_vb, stride_vh, stride_vt, BLOCK, PAGED)
                m_i, l_i, acc = attend_block(q, K, V, k_base, v_base, stride_kt, stride_vt, m_i, l_i, acc,
                                             qk_scale, qpos, kpos, n, BLOCK, HEAD_DIM, True, PREC, lo, sink, True)
            n_full = tl.maximum(n_full, n_head)  # a head that reaches the diagonal leaves no full block
        # Fully visible blocks, KB_STEP per step: no mask work at all. Two blocks make one [2 * BLOCK] key
        # tile gathered from two pages (bigger MMAs, half the per-step softmax and rescale overhead).
        n_main = n_full - (n_full - n_head) % KB_STEP
        kr = tl.arange(0, KB_STEP * BLOCK)
        second = kr >= BLOCK
        for j in range(n_head, n_main, KB_STEP):
            kb = tl.load(idx_row + j)
            k_rows = kv_block_offset(PT, pt_row, CU_K, seq, kb, kvh, stride_kb, stride_kh, stride_kt, BLOCK, PAGED)
            v_rows = kv_block_offset(PT, pt_row, CU_K, seq, kb, kvh, stride_vb, stride_vh, stride_vt, BLOCK, PAGED)
            if KB_STEP == 2:
                kb2 = tl.load(idx_row + j + 1)
                k2 = kv_block_offset(PT, pt_row, CU_K, seq, kb2, kvh, stride_kb, stride_kh, stride_kt, BLOCK, PAGED)
                v2 = kv_block_offset(PT, pt_row, CU_K, seq, kb2, kvh, stride_vb, stride_vh, stride_vt, BLOCK, PAGED)
                k_rows = tl.where(second, k2, k_rows)
                v_rows = tl.where(second, v2, v_rows)
            kr_t = (kr % BLOCK).to(tl.int64)
            m_i, l_i, acc = attend_rows(q, K, V, k_rows + kr_t * stride_kt, v_rows + kr_t * stride_vt, m_i, l_i, acc,
                                        qk_scale, qpos, kr, n, KB_STEP * BLOCK, HEAD_DIM, False, PREC)
        if KB_STEP == 2:
            for j in range(n_main, n_full):  # the odd one out of the pairs: still unmasked
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


@dataclass(frozen=True)
class PrefillConfig:
    """One launch configuration: query rows per tile (tokens x padded group size, so register pressure is
    the same for every g), key blocks per inner step, warps and software-pipeline stages."""

    rows: int
    kb_step: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        if self.rows < 16 or self.rows & (self.rows - 1) or self.kb_step not in (1, 2):
            raise ValueError(f"bad prefill config {self}")
        if self.num_warps not in (4, 8, 16) or not 1 <= self.num_stages <= 5:
            raise ValueError(f"bad prefill config {self}")

    def block_qt(self, g_pad: int, block: int) -> int:
        return min(block, max(1, self.rows // g_pad))


# The autotune space, keyed on static things only (G, HEAD_DIM, PAGED and the dtypes Triton adds), so it tunes
# once per model layout, never inside a CUDA-graph capture or per request; the first entry is the old default.
# It tunes on whatever prompt comes first (a short warm-up, often), so no config may be far off at long
# prompts: (256 rows, two key blocks a step, 16 warps, 2 stages) took 1723 ms where the others took 482-550 ms
# (streaming's prefill of 131072 tokens, 4 layers of Llama-3.1-8B, H200) and was dropped.
CONFIGS = (
    PrefillConfig(64, 1, 4, 3), PrefillConfig(64, 1, 4, 4), PrefillConfig(64, 2, 4, 2), PrefillConfig(64, 2, 4, 3),
    PrefillConfig(128, 1, 8, 2), PrefillConfig(128, 1, 8, 3), PrefillConfig(128, 2, 8, 2), PrefillConfig(128, 2, 8, 3),
    PrefillConfig(128, 1, 4, 3), PrefillConfig(256, 1, 8, 2), PrefillConfig(256, 1, 16, 2),
)
_tuned: dict[tuple[int, int], object] = {}


def configs_for(g_pad: int, block: int) -> list[PrefillConfig]:
    """The configs whose row count a group of ``g_pad`` heads reaches with at most ``block`` query tokens per
    tile (a 256-row config means 64 rows for g = 1: a warp count meant for a bigger tile); all if none does."""
    fit = [c for c in CONFIGS if c.block_qt(g_pad, block) * g_pad == c.rows]
    return fit or list(CONFIGS)


def _kernel_for(g_pad: int, block: int):
    key = (g_pad, block)
    if key not in _tuned:
        uniq = {}
        for c in configs_for(g_pad, block):
            qt = c.block_qt(g_pad, block)
            uniq[(qt, c.kb_step, c.num_warps, c.num_stages)] = triton.Config(
                {"BLOCK_QT": qt, "KB_STEP": c.kb_step}, num_warps=c.num_warps, num_stages=c.num_stages)
        _tuned[key] = triton.autotune(list(uniq.values()), key=["G", "HEAD_DIM", "PAGED"])(_prefill_kernel)
    return _tuned[key]


def block_sparse_prefill(q: torch.Tensor, kv: KVSource, sel: PackedBlockSelection, cu_seqlens_q: torch.Tensor,
                         scale: float | None = None, block_qt: int | None = None, out: torch.Tensor | None = None,
                         lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged block-sparse causal attention. q: [T, h, d]; returns out [T, h, d] (q's dtype), lse [T, h] fp32.

    ``out``/``lse`` may be given (preallocated buffers, e.g. views into a larger output); ``block_qt`` pins
    the query tokens per tile and skips autotuning (the interpreter uses one tile per query block).
    """
    return _prefill(q, kv, sel, cu_seqlens_q, scale, out, lse, None, block_qt)


def block_sparse_prefill_config(q: torch.Tensor, kv: KVSource, sel: PackedBlockSelection,
                                cu_seqlens_q: torch.Tensor, config: PrefillConfig, scale: float | None = None,
                                out: torch.Tensor | None = None, lse: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_sparse_prefill`` with one pinned ``PrefillConfig`` (no autotuning): config sweeps and tests."""
    return _prefill(q, kv, sel, cu_seqlens_q, scale, out, lse, config, None)


def _prefill(q: torch.Tensor, kv: KVSource, sel: PackedBlockSelection, cu_seqlens_q: torch.Tensor,
             scale: float | None, out: torch.Tensor | None, lse: torch.Tensor | None, config: PrefillConfig | None,
             block_qt: int | None) -> tuple[torch.Tensor, torch.Tensor]:
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
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")  # the unmasked softmax scales inside exp2
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(T, h, dtype=torch.float32, device=q.device) if lse is None else lse
    idx = sel.indices
    if idx.dtype != torch.int32 or idx.stride(-1) != 1:
        idx = idx.to(torch.int32).contiguous()
    total_qb, max_sel = idx.shape[1], idx.shape[2]
    if total_qb == 0 or T == 0:
        return out, lse
    window = sel.window_lo is not None
    wlo = sel.window_lo.to(torch.int32).contiguous() if window else cu_seqlens_q  # unread without a window
    if window and wlo.numel() != T:
        raise ValueError(f"window_lo has {wlo.numel()} rows, q has {T}")
    args = (q, a.k, a.v, out, lse, idx, sel.qblock_seq.to(torch.int32), sel.qblock_start.to(torch.int32),
            cu_seqlens_q.to(torch.int32),
            a.seqlens, a.cu_k, a.page_table, wlo, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            lse.stride(0), lse.stride(1), *a.k_strides, *a.v_strides, idx.stride(0), idx.stride(1), a.pt_stride,
            total_qb, max_sel, scale * LOG2E, sel.sink)
    meta = dict(G=g, G_PAD=g_pad, HEAD_DIM=d, BLOCK=b, PAGED=a.paged, PREC=dot_precision(q.dtype),
                CNT_CHUNK=_CNT_CHUNK, WINDOW=window)
    if config is None and block_qt is None and interpreting():
        block_qt = b  # one program per query block: the interpreter pays per program
    if config is None and block_qt is not None:
        config = PrefillConfig(max(16, block_qt * g_pad), 1, 4, 3)
        meta["BLOCK_QT"] = block_qt
    if config is not None:
        qt = meta.setdefault("BLOCK_QT", config.block_qt(g_pad, b))
        _prefill_kernel[(total_qb * (b // qt), a.h_kv)](*args, KB_STEP=config.kb_step, **meta,
                                                        num_warps=config.num_warps, num_stages=config.num_stages)
    else:
        def grid(meta_: dict) -> tuple[int, int]:
            return (total_qb * (b // meta_["BLOCK_QT"]), a.h_kv)

        _kernel_for(g_pad, b)[grid](*args, **meta)
    return out, lse
