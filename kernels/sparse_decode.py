"""Split-K sparse decode attention (flash decoding over a selection) with native GQA and a ragged batch.

Packed selection format: ``indices`` int32 ``[batch, h_kv, max_sel]``, row (i, j) the ascending entries of
sequence i's ``TokenSelection.indices[j]`` padded with ``SENTINEL`` (``pack_token_selections``). An entry is a
token (``unit=1``) or a block of ``unit`` tokens (block e covers tokens ``e*unit .. e*unit+unit-1``); with a
paged cache whose page size equals ``unit`` a block entry is simply a logical page, read through the page
table. ``q``: ``[batch, h, d]``, one new query per sequence, the newest of its ``n`` keys (from the KV source).

Grid: (split, KV head, sequence). The valid entries of a list are a prefix (it is ascending and padded at the
end); the splits share that prefix evenly: each program learns the row's valid count (one load of the list's
last entry when the list is full, else counted) and owns a contiguous range of it. The
split count comes from the list's width, so a list padded past its entries (a captured step's, sized for its
width bucket) would leave the splits past them idle if they cut the width. A program processes the g query
heads of its KV head together as the M side of ``tl.dot`` (padded to 16 rows), so every selected K/V row is
read once for the whole group, and writes a normalised partial output and its log2-sum-exp.

One launch (``sparse_decode``): after writing its partial, each program bumps an int32 counter of its
(sequence, KV head) in a small persistent workspace; the program that brings it to ``num_splits`` is the
last, combines the group's partials into the output and sets the counter back to 0, so the next call (or
graph replay) finds the workspace clean. With a single split the program writes the output directly. (A
separate combine kernel after the splits measured 1.1-1.2x slower at batch 1.) The split
count comes from shapes and the SM count only and nothing is read back to the host, so a call can be
captured in a CUDA graph. Calls sharing a device must be stream-ordered (they share the counters).
"""

from __future__ import annotations

import functools
import math

import torch

from .common import (
    LOG2E,
    KVSource,
    check_head_dim,
    dot_precision,
    finish_rows,
    interpreting,
    kv_args,
    kv_row_offsets,
    next_pow2,
    softmax_update,
    tl,
    triton,
)
from .formats import pack_token_selections  # noqa: F401 - re-exported

# The kernel's tiling: 128 keys per inner step in two pipeline stages, for every entry size. The split-K loop is a
# chain of dependent gathers (list entry, page table, K/V), so twice the bytes in flight of 64 keys a step pay: an
# H200 read dense page lists at 3.2-4.3 TB/s with them against 2.5-3.5 TB/s with 64 (bench_roofline.py's profile),
# and token and Quest-page lists at a tenth of 131072 keys fastest with them too (bench_decode_tuning.py).
_BLOCK_N = 128
_STAGES = 2
# The split model's estimate of the programs one SM holds keeps the tiling it was fitted with (64 keys, three
# stages): its choices at batch 1 were measured near the best.
_MODEL_BLOCK_N = 64
_MODEL_STAGES = 3
# Entries shorter than a page (tokens, Quest's pages) are split to about this many keys per program at least: the
# model alone keeps a few long programs per row at large batches, which read token lists a quarter slower.
_KEYS_PER_SPLIT = 512
_CNT_CHUNK = 1024  # entries counted per step (only rows whose list is padded count)
_MAX_SPLITS = 128
# The split heuristic's cost model, in selected tokens' worth of time: a program's fixed latency chain
# (q and index loads, the first K/V round trip, the partial store and the counter) and, per split, the
# last program's share of the combine.
_FIXED_TOKENS = 64
_COMBINE_TOKENS = 2
_SMEM_PER_SM = 200 * 1024  # what the K/V pipeline buffers may use of an H100/H200 SM's 228 KB
_COMBINE_ELEMS = 8192  # partial-output elements per combine step (64 fp32 registers per thread)
_WORKSPACE_MIN = 4096
_workspaces: dict[torch.device, torch.Tensor] = {}
_retired: list[torch.Tensor] = []  # outgrown workspaces stay allocated: a captured graph may still use one


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=4096)
def _best_split(rows: int, max_sel: int, unit: int, slots: int) -> tuple[int, int]:
    # Keep every split's token count a multiple of the inner step. Pages keep the one-page model (its choice was
    # also the fastest for the two-page steps where it was measured: dense decode's lists).
    step = max(1, (_MODEL_BLOCK_N if unit >= 64 else _BLOCK_N) // unit)
    best: tuple[float, int, int] | None = None
    top = min(_MAX_SPLITS, -(-max_sel // step))
    # short entries: at least ~_KEYS_PER_SPLIT keys a program (the splits only grow with s)
    least = min(top, -(-max_sel * unit // _KEYS_PER_SPLIT)) if unit < 64 else 1
    for s in range(max(least, 1), top + 1):
        per = _ceil_div(_ceil_div(max_sel, s), step) * step
        splits = -(-max_sel // per)
        waves = -(-(rows * splits) // slots)
        cost = waves * (_FIXED_TOKENS + per * unit) + (splits > 1) * splits * _COMBINE_TOKENS
        if best is None or cost < best[0]:
            best = (cost, splits, per)
    assert best is not None
    return best[1], best[2]


def num_splits_for(batch: int, h_kv: int, max_sel: int, unit: int, device: torch.device, head_dim: int = 128,
                   elt_size: int = 2) -> tuple[int, int]:
    """(splits, entries per split) from shapes only (cached). Picks the split count of least modelled time:
    the programs run in waves of (SMs x programs that fit an SM's shared memory), each wave as long as its
    programs' fixed cost plus their tokens, plus the combine's cost per split. Batch 1 thus spreads the few
    MB of selected KV over the whole GPU in one wave; large batches keep long, well-pipelined loops and
    avoid a mostly empty last wave."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    per_sm = max(1, min(8, _SMEM_PER_SM // (_MODEL_STAGES * 2 * _MODEL_BLOCK_N * head_dim * elt_size)))
    return _best_split(max(1, batch * h_kv), max(1, max_sel), unit, sms * per_sm)


def _workspace(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (sequence, KV head), kept per device; the kernel leaves them at 0."""
    ws = _workspaces.get(device)
    if ws is None or ws.numel() < n:
        if ws is not None:
            _retired.append(ws)
        ws = torch.zeros(max(_WORKSPACE_MIN, next_pow2(n)), dtype=torch.int32, device=device)
        _workspaces[device] = ws
    return ws


if triton is not None:

    @triton.jit
    def _combine_group(PO, PL, Out, LSE, seq, kvh, h, num_splits, stride_ob, stride_oh, stride_lb, stride_lh,
                       G: tl.constexpr, G_P2: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr):
        """Merges the ``num_splits`` partials of the g heads of (seq, kvh) into Out / LSE (natural log)."""
        gi = tl.arange(0, G_P2)
        g_ok = gi < G
        head = kvh * G + gi
        row = (seq * h + head).to(tl.int64) * num_splits
        sc = tl.arange(0, CHUNK)
        d = tl.arange(0, HEAD_DIM)
        m_i = tl.full([G_P2], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([G_P2], dtype=tl.float32)
        acc = tl.zeros([G_P2, HEAD_DIM], dtype=tl.float32)
        for c in range(0, num_splits, CHUNK):
            ok = g_ok[:, None] & (c + sc < num_splits)[None, :]
            off = row[:, None] + c + sc[None, :]
            # .cg: read the other programs' partials from L2, never from a stale L1 line.
            part_l = tl.load(PL + off, mask=ok, other=float("-inf"), cache_modifier=".cg")
            part_o = tl.load(PO + off[:, :, None] * HEAD_DIM + d[None, None, :], mask=ok[:, :, None], other=0.0,
                             cache_modifier=".cg")
            m_new = tl.maximum(m_i, tl.max(part_l, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_ref)
            w = tl.exp2(part_l - m_ref[:, None])
            acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * part_o, 1)
            l_i = l_i * alpha + tl.sum(w, 1)
            m_i = m_new
        out, lse2 = finish_rows(acc, m_i, l_i)
        tl.store(Out + seq.to(tl.int64) * stride_ob + head[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=g_ok[:, None])
        tl.store(LSE + seq.to(tl.int64) * stride_lb + head * stride_lh, lse2 * 0.6931471805599453, mask=g_ok)

    @triton.jit
    def _decode_split_kernel(Q, K, V, PO, PL, IDX, SEQ_K, CU_K, PT, Out, LSE, CNT, LO, sink,
                             stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                             stride_ib, stride_ih, stride_pt, stride_ob, stride_oh, stride_lb, stride_lh,
                             max_sel, num_splits, qk_scale,
                             G: tl.constexpr, G_PAD: tl.constexpr, G_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                             UNIT: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr, BLOCK_N: tl.constexpr,
                             PREC: tl.constexpr, CNT_CHUNK: tl.constexpr, COMBINE_CHUNK: tl.constexpr,
                             WINDOW: tl.constexpr):
        split = tl.program_id(0)
        kvh = tl.program_id(1)
        seq = tl.program_id(2)
        h_kv = tl.num_programs(1)
        n = tl.load(SEQ_K + seq)
        if WINDOW:
            lo = tl.load(LO + seq)
        idx_row = IDX + seq.to(tl.int64) * stride_ib + kvh.to(tl.int64) * stride_ih
        # The row's valid entries (a prefix of its list), shared evenly by the splits: a list padded past them (a
        # captured step's, sized for its width bucket) would otherwise leave the splits past them idle. A full list
        # (its last entry valid: the usual top-k list) takes one load; a padded one is counted.
        rc = max_sel
        if tl.load(idx_row + tl.maximum(max_sel - 1, 0), mask=max_sel > 0, other=0) < 0:
            rc = 0
            for c in range(0, max_sel, CNT_CHUNK):
                e_off = c + tl.arange(0, CNT_CHUNK)
                e = tl.load(idx_row + e_off, mask=e_off < max_sel, other=-1)
                rc += tl.sum((e >= 0).to(tl.int32))
        step: tl.constexpr = max(1, BLOCK_N // UNIT)  # whole inner tiles per split, as the host's split choice
        per_row = tl.cdiv(tl.cdiv(rc, num_splits), step) * step
        e0 = split * per_row
        cnt = tl.maximum(tl.minimum(e0 + per_row, rc) - e0, 0)
        gi = tl.arange(0, G_PAD)
        head = kvh * G + gi
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + seq.to(tl.int64) * stride_qb + head[:, None] * stride_qh + d[None, :],
                    mask=(gi < G)[:, None], other=0.0)
        units = cnt * UNIT
        pt_row = seq.to(tl.int64) * stride_pt
        m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, HEAD_DIM], dtype=tl.float32)
        for u0 in range(0, units, BLOCK_N):
            u = u0 + tl.arange(0, BLOCK_N)
            u_ok = u < units
            ent = tl.load(idx_row + e0 + u // UNIT, mask=u_ok, other=0)
            tok = ent * UNIT + u % UNIT
            ok = u_ok & (tok < n)  # the last block may run past the sequence's end
            if WINDOW:  # a sliding window with sinks: inside the listed blocks, only sinks and keys from lo up
                ok = ok & ((tok < sink) | (tok >= lo))
            tok = tl.where(ok, tok, 0)
            # K and V gathers both issued before the first dot: one memory round trip per step, not two.
            k_off = kv_row_offsets(PT, pt_row, CU_K, seq, tok, kvh, stride_kb, stride_kh, stride_kt, PAGE, PAGED)
            v_off = kv_row_offsets(PT, pt_row, CU_K, seq, tok, kvh, stride_vb, stride_vh, stride_vt, PAGE, PAGED)
            k = tl.load(K + k_off[:, None] + d[None, :], mask=ok[:, None], other=0.0)
            v = tl.load(V + v_off[:, None] + d[None, :], mask=ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            s = tl.where(ok[None, :], s, float("-inf"))
            m_i, l_i, p, alpha = softmax_update(s, m_i, l_i, True)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        out, lse2 = finish_rows(acc, m_i, l_i)
        g_ok = gi < G
        if num_splits == 1:  # the only split: no partials, no counter
            tl.store(Out + seq.to(tl.int64) * stride_ob + head[:, None] * stride_oh + d[None, :],
                     out.to(Out.dtype.element_ty), mask=g_ok[:, None])
            tl.store(LSE + seq.to(tl.int64) * stride_lb + head * stride_lh, lse2 * 0.6931471805599453, mask=g_ok)
        else:
            row = (seq * (h_kv * G) + head).to(tl.int64) * num_splits + split  # [batch, h, splits]
            tl.store(PO + row[:, None] * HEAD_DIM + d[None, :], out, mask=g_ok[:, None])
            tl.store(PL + row, lse2, mask=g_ok)
            # Every thread's partial stores precede the counter's release (one thread does the atomic).
            tl.debug_barrier()
            ctr = CNT + seq * h_kv + kvh
            done = tl.atomic_add(ctr, 1, sem="acq_rel", scope="gpu")
            if done == num_splits - 1:
                tl.store(ctr, 0)  # every split has arrived: reset for the next call
                _combine_group(PO, PL, Out, LSE, seq, kvh, h_kv * G, num_splits, stride_ob, stride_oh,
                               stride_lb, stride_lh, G, G_P2, HEAD_DIM, COMBINE_CHUNK)


def sparse_decode(q: torch.Tensor, kv: KVSource, indices: torch.Tensor, unit: int = 1, scale: float | None = None,
                  num_splits: int | None = None, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                  window_lo: torch.Tensor | None = None, sink: int = 0, block_n: int | None = None,
                  stages: int | None = None, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [batch, h, d]; indices: int32 [batch, h_kv, max_sel]. Returns out [batch, h, d] (q's dtype) and
    lse [batch, h] fp32 (natural log); a query with no valid key gets zeros and lse = -inf. ``out``/``lse``
    may be preallocated (static buffers for CUDA graphs). One launch: the splits combine themselves.
    ``window_lo`` [batch] (with ``sink``) keeps, inside the selected entries, only the keys below ``sink`` and those
    at or past the row's bound: a sliding window with sinks attended by whole blocks (PSAW's decode).
    The splits share each (row, KV head)'s valid entries, not the list's width: a dense list padded to a captured
    graph's width bucket (a 32K-token row's 513 pages in a 1024-wide list) had left half the splits with no entry
    and the other half with twice the work. ``block_n`` (keys per inner step, a power of two >= 16), ``stages`` and
    ``num_warps`` override the kernel's tiling, for ``benchmarks/bench_decode_tuning.py``."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    batch, h, d = q.shape
    a = kv_args(kv)
    check_head_dim(d)
    if h % a.h_kv or a.d != d or indices.shape[:2] != (batch, a.h_kv):
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, KV heads {a.h_kv}, indices {tuple(indices.shape)}")
    if unit < 1 or unit & (unit - 1):
        raise ValueError(f"unit must be a power of two, got {unit}")
    g = h // a.h_kv
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    q = q if q.stride(-1) == 1 else q.contiguous()
    idx = indices if indices.dtype == torch.int32 and indices.stride(-1) == 1 else indices.to(torch.int32).contiguous()
    max_sel = idx.shape[2]
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(batch, h, dtype=torch.float32, device=q.device) if lse is None else lse
    if batch == 0:
        return out, lse
    if num_splits is None:
        splits, _ = num_splits_for(batch, a.h_kv, max(max_sel, 1), unit, q.device, d, q.element_size())
    else:
        per = -(-max(max_sel, 1) // num_splits)
        splits = -(-max(max_sel, 1) // per)
    # With one split the kernel writes the output directly: no partials to hold.
    ps = 0 if splits == 1 else splits
    part_o = torch.empty(max(1, batch * h * ps * d), dtype=torch.float32, device=q.device)  # [batch, h, splits, d]
    part_l = torch.empty(max(1, batch * h * ps), dtype=torch.float32, device=q.device)  # [batch, h, splits]
    counters = _workspace(q.device, batch * a.h_kv)
    g_p2 = next_pow2(g)
    # Token gathers from a paged cache need the page size; packed sources ignore PAGE (any value works).
    page = a.page_size if a.paged else 1
    lo = a.seqlens if window_lo is None else window_lo.to(torch.int32).contiguous()  # unread without a window
    block_n, stages = block_n or _BLOCK_N, stages or _STAGES
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    _decode_split_kernel[(splits, a.h_kv, batch)](
        q, a.k, a.v, part_o, part_l, idx, a.seqlens, a.cu_k, a.page_table, out, lse, counters, lo, sink,
        q.stride(0), q.stride(1), *a.k_strides, *a.v_strides, idx.stride(0), idx.stride(1), a.pt_stride,
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), max_sel, splits, scale * LOG2E,
        G=g, G_PAD=max(16, g_p2), G_P2=g_p2, HEAD_DIM=d, UNIT=unit, PAGE=page, PAGED=a.paged, BLOCK_N=block_n,
        PREC=dot_precision(q.dtype), CNT_CHUNK=_CNT_CHUNK,
        COMBINE_CHUNK=max(1, min(64, _COMBINE_ELEMS // (g_p2 * d))), WINDOW=window_lo is not None, num_warps=num_warps,
        num_stages=1 if interpreting() else stages)
    return out, lse
