"""Quest's prefill block scores for a packed batch, read from the per-page bounds through the page table.

Rows are the step's packed query blocks as ``PrefillView.qblocks`` lists them (``query_block_rows``): per
sequence in batch order, its blocks ``q_start // block`` to ``(n - 1) // block``; ``row_seq [R]``, ``row_qb
[R]`` name each one's sequence and absolute block. Inputs: packed ``q [T, h, d]`` with ``cu_q [B + 1]``, the
bounds ``lo, hi [pages + 1, h_kv, S, d]`` (per cache page and KV head, the element-wise min and max of the
keys of each of its S Quest pages), ``page_table [B, W]``, ``seqlens [B]`` -> fp32 ``[h_kv, R, nkb]``: for
each KV head, row r and key block j <= row_qb[r], the max over the Quest pages of block j (those below n;
``block`` a multiple of ``quest_page``) of ``max_g sum_d max(m_d lo_d, m_d hi_d)``, m the mean of the row's
valid queries (query head g of the group) - ``Quest._prefill_rows``' score, its group reduced by max as in
``scorer_reference.page_upper_bound``. Entries past the causal limit (j > row_qb[r], every j past the
sequence's blocks included) are -inf; the selection masks them anyway. The PyTorch form is the CPU path and
the reference (per sequence, sharing ``block_scores`` with ``_prefill_rows``: bit-equal to it on one device).

The Triton form runs two launches and reads the bounds in place (no fp32 copy of them, no per-page
scores): one program per (row, query head) averages the row's queries in fp32 (``[R, h, d]``, a few MB),
then one program per (tile of key blocks, tile of ``QT`` rows, KV head) scores the tile's ``KBT * SB`` Quest
pages (``SB = block / quest_page``) for the ``QT * g`` query heads over chunks of ``DK`` head dims (bounds
up-cast on load; ``q+ . hi`` and ``q- . lo`` summed apart and added, as the reference's two products), then
maxes over the group and each block's pages. The products are tensor-core dots at "tf32x3" by default (three
TF32 products per fp32 one: fp32's accuracy, and the bf16 bounds are exact in TF32), or exact fp32 FMAs
(``precision="fma"``), which on an H200 took 3.0 ms a layer at 32K, slower than the per-sequence fp32 GEMMs
they replaced (2.5 ms). A row tile is consecutive packed rows; where it spans sequences the program scores
once per sequence with that sequence's page table and keeps each row's own. Tiles wholly above every row's
diagonal store -inf without reading anything. ``benchmarks/bench_quest_prefill.py`` takes each knob as a flag.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .common import next_pow2, tl, triton
from .scorer_reference import page_upper_bound

_CHUNK_ELEMS = 1 << 24  # per-page scores materialised per chunk of query blocks in the PyTorch form


def block_scores(qmean: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, block: int, quest_page: int,
                 nkb: int) -> torch.Tensor:
    """One sequence's block scores in PyTorch: query-block means qmean [h_kv, g, nqb, d] against its Quest pages'
    bounds lo, hi [h_kv, pages, d] (fp32) -> [h_kv, nqb, nkb], each key block's max over its pages (-inf past
    the pages), the group reduced by ``page_upper_bound``; chunked so that at most ``_CHUNK_ELEMS`` per-page
    scores exist at once. ``Quest._prefill_scores`` (the reference) and the PyTorch form below share it."""
    h_kv, g, nqb, _ = qmean.shape
    pages, sub = lo.shape[1], block // quest_page
    score = torch.empty(h_kv, nqb, nkb, device=qmean.device)
    step = max(1, _CHUNK_ELEMS // (h_kv * g * pages))
    for c0 in range(0, nqb, step):
        ub = page_upper_bound(qmean[:, :, c0: c0 + step], lo, hi)
        ub = F.pad(ub, (0, nkb * sub - pages), value=-math.inf)
        score[:, c0: c0 + step] = ub.view(h_kv, ub.shape[1], nkb, sub).amax(-1)
    return score


def query_block_rows(q_lens: list[int], ctx_lens: list[int], block: int,
                     device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``row_seq``, ``row_qb`` (int32 [R]) of a step's packed query blocks, as ``PrefillView.qblocks``."""
    seq, qb = [], []
    for i, (n_q, n) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        first, last = (n - n_q) // block, (n - 1) // block
        seq += [i] * (last - first + 1)
        qb += range(first, last + 1)
    t = torch.tensor([seq, qb], dtype=torch.int32).to(device)
    return t[0], t[1]


def quest_prefill_scores_torch(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, page_table: torch.Tensor,
                               seqlens: torch.Tensor, cu_q: torch.Tensor, row_seq: torch.Tensor,
                               row_qb: torch.Tensor, block: int, quest_page: int, nkb: int) -> torch.Tensor:
    """The PyTorch form, one sequence at a time (host reads of the metadata: the CPU path and the oracle)."""
    h, d = q.shape[1:]
    h_kv, b, p, cache_page = lo.shape[1], block, quest_page, lo.shape[2] * quest_page
    out = torch.full((h_kv, row_seq.numel(), nkb), -math.inf, device=q.device)
    cu, lens, seqs, qbs = cu_q.tolist(), seqlens.tolist(), row_seq.tolist(), row_qb.tolist()
    r = 0
    for i, n in enumerate(lens):
        q_start = n - (cu[i + 1] - cu[i])
        qb0, nqb = q_start // b, (n - 1) // b - q_start // b + 1
        if seqs[r: r + nqb] != [i] * nqb or qbs[r: r + nqb] != list(range(qb0, qb0 + nqb)):
            raise ValueError(f"rows {r}.. are not sequence {i}'s query blocks {qb0}..{qb0 + nqb - 1}")
        # The query blocks' means of their valid queries, as ``baselines.query_blocks`` and ``_prefill_rows``.
        lead = q_start - qb0 * b
        qf = F.pad(q[cu[i]: cu[i + 1]].float(), (0, 0, 0, 0, lead, nqb * b - lead - (n - q_start)))
        qf = qf.view(nqb, b, h, d)
        pos = qb0 * b + torch.arange(nqb * b, device=q.device).view(nqb, b)
        valid = (pos >= q_start) & (pos < n)
        qmean = (qf * valid[..., None, None]).sum(1) / valid.sum(1).clamp(min=1)[:, None, None]  # [nqb, h, d]
        qmean = qmean.view(nqb, h_kv, -1, d).permute(1, 2, 0, 3)  # [h_kv, g, nqb, d]
        table = page_table[i, : -(-n // cache_page)].long()
        pages, nkb_i = -(-n // p), -(-n // b)
        lo_i = lo[table].transpose(0, 1).flatten(1, 2)[:, :pages].float()  # [h_kv, pages, d]
        hi_i = hi[table].transpose(0, 1).flatten(1, 2)[:, :pages].float()
        score = block_scores(qmean, lo_i, hi_i, b, p, nkb_i)
        qb = torch.arange(qb0, qb0 + nqb, device=q.device)
        causal = torch.arange(nkb_i, device=q.device)[None, :] <= qb[:, None]
        out[:, r: r + nqb, :nkb_i] = score.masked_fill(~causal, -math.inf)
        r += nqb
    if r != len(seqs):
        raise ValueError(f"{len(seqs)} rows for the batch's {r} query blocks")
    return out


if triton is not None:

    @triton.jit
    def _mean_kernel(Q, CU, SEQ, RSEQ, RQB, Out, stride_qt, stride_qh, stride_or, stride_oh, head_dim,
                     BLOCK: tl.constexpr, TB: tl.constexpr, D_PAD: tl.constexpr):
        r = tl.program_id(0)
        hh = tl.program_id(1).to(tl.int64)
        s = tl.load(RSEQ + r)
        qb = tl.load(RQB + r)
        n = tl.load(SEQ + s)
        c0 = tl.load(CU + s)
        q_start = n - (tl.load(CU + s + 1) - c0)
        d = tl.arange(0, D_PAD)
        d_ok = d < head_dim
        acc = tl.zeros([D_PAD], tl.float32)
        for t0 in tl.static_range(0, BLOCK, TB):
            pos = qb * BLOCK + t0 + tl.arange(0, TB)
            ok = (pos >= q_start) & (pos < n)
            tok = tl.where(ok, c0 + pos - q_start, 0).to(tl.int64)
            x = tl.load(Q + tok[:, None] * stride_qt + hh * stride_qh + d[None, :], mask=ok[:, None] & d_ok[None, :],
                        other=0.0)
            acc += tl.sum(x.to(tl.float32), 0)
        cnt = tl.minimum(qb * BLOCK + BLOCK, n) - tl.maximum(qb * BLOCK, q_start)
        tl.store(Out + r * stride_or + hh * stride_oh + d, acc / tl.maximum(cnt, 1).to(tl.float32), mask=d_ok)

    @triton.jit
    def _score_kernel(QM, LO, HI, PT, SEQ, RSEQ, RQB, Out, n_rows, nkb, head_dim, stride_qr, stride_qh,
                      stride_lp, stride_lh, stride_ls, stride_tb, stride_oh, stride_or, QPAGE: tl.constexpr,
                      S: tl.constexpr, SB: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, QT: tl.constexpr,
                      KBT: tl.constexpr, DK: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
        kvh = tl.program_id(2).to(tl.int64)
        kb0 = tl.program_id(0) * KBT
        r = tl.program_id(1) * QT + tl.arange(0, QT)
        r_ok = r < n_rows
        rseq = tl.load(RSEQ + r, mask=r_ok, other=-1)
        rqb = tl.load(RQB + r, mask=r_ok, other=-1)
        kb = kb0 + tl.arange(0, KBT)
        res = tl.full([QT, KBT], float("-inf"), tl.float32)
        if kb0 <= tl.max(rqb, 0):  # some row of the tile reaches the tile's first key block
            m = tl.arange(0, QT * G_PAD)  # the M side: row m // G_PAD, query head m % G_PAD of the group
            rm = tl.program_id(1) * QT + m // G_PAD
            gm = m % G_PAD
            rm_ok = (rm < n_rows) & (gm < G)
            seq_m = tl.load(RSEQ + rm, mask=rm < n_rows, other=-1)
            q_off = rm.to(tl.int64) * stride_qr + (kvh * G + gm) * stride_qh
            jp = kb0 * SB + tl.arange(0, KBT * SB)  # the tile's Quest pages
            dd = tl.arange(0, DK)
            s_first = tl.min(tl.where(r_ok, rseq, 2147483647), 0)
            for s in range(s_first, tl.max(rseq, 0) + 1):
                n_pages = (tl.load(SEQ + s) + QPAGE - 1) // QPAGE
                if kb0 * SB < n_pages:
                    # Past the sequence's pages the table may hold anything: neither it nor the bounds are read.
                    live = jp < n_pages
                    pg = tl.load(PT + s * stride_tb + jp // S, mask=live, other=0).to(tl.int64)
                    b_off = pg * stride_lp + kvh * stride_lh + (jp % S) * stride_ls
                    q_ok = rm_ok & (seq_m == s)
                    acc_hi = tl.zeros([QT * G_PAD, KBT * SB], tl.float32)
                    acc_lo = tl.zeros([QT * G_PAD, KBT * SB], tl.float32)
                    for d0 in range(0, head_dim, DK):
                        d = d0 + dd
                        d_ok = d < head_dim
                        qv = tl.load(QM + q_off[:, None] + d[None, :], mask=q_ok[:, None] & d_ok[None, :], other=0.0)
                        b_mask = live[:, None] & d_ok[None, :]
                        hi = tl.load(HI + b_off[:, None] + d[None, :], mask=b_mask, other=0.0).to(tl.float32)
                        lo = tl.load(LO + b_off[:, None] + d[None, :], mask=b_mask, other=0.0).to(tl.float32)
                        if DOT:  # tensor-core products; "tf32x3" keeps fp32's accuracy (bf16 bounds are exact in tf32)
                            acc_hi = tl.dot(tl.maximum(qv, 0.0), tl.trans(hi), acc_hi, input_precision=PREC)
                            acc_lo = tl.dot(tl.minimum(qv, 0.0), tl.trans(lo), acc_lo, input_precision=PREC)
                        else:
                            acc_hi += tl.sum(tl.maximum(qv, 0.0)[:, None, :] * hi[None, :, :], 2)
                            acc_lo += tl.sum(tl.minimum(qv, 0.0)[:, None, :] * lo[None, :, :], 2)
                    ub = tl.where((gm < G)[:, None] & live[None, :], acc_hi + acc_lo, float("-inf"))
                    blk = tl.max(tl.max(tl.reshape(ub, [QT, G_PAD, KBT, SB]), 3), 1)  # [QT, KBT]
                    res = tl.where((rseq == s)[:, None], blk, res)
            res = tl.where(kb[None, :] <= rqb[:, None], res, float("-inf"))
        out = Out + kvh * stride_oh + r.to(tl.int64)[:, None] * stride_or + kb[None, :]
        tl.store(out, res, mask=r_ok[:, None] & (kb < nkb)[None, :])


# Tile defaults (query heads of rows x the group padded, Quest pages, head dims per chunk) of the two forms of
# the products: tensor-core dots (the default, "tf32x3") and exact FMAs ("fma"); 4 warps either way.
_TILES = {"dot": (64, 64, 32), "fma": (16, 32, 8)}
_PREC = "tf32x3"
_WARPS = 4


def quest_prefill_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, page_table: torch.Tensor,
                         seqlens: torch.Tensor, cu_q: torch.Tensor, row_seq: torch.Tensor, row_qb: torch.Tensor,
                         block: int, quest_page: int, nkb: int, rows: int | None = None, pages: int | None = None,
                         dk: int | None = None, num_warps: int = _WARPS, precision: str = _PREC) -> torch.Tensor:
    """The Triton form (no host read). ``rows`` (query blocks per scoring program; default 16 query heads'
    worth), ``pages`` (Quest pages per program, rounded up to whole key blocks), ``dk`` and ``num_warps``
    (powers of two) are knobs for ``benchmarks/bench_quest_prefill.py``. ``precision``: the products as
    ``tl.dot`` with that ``input_precision`` ("tf32x3", the default: fp32's accuracy on tensor cores, the bf16
    bounds exact in tf32; "ieee"; the tile then needs 16 query heads, 16 pages and 16 head dims at least), or
    "fma": exact fp32 FMAs."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    _, h, d = q.shape
    _, h_kv, sub, _ = lo.shape
    if lo.stride(-1) != 1 or hi.stride() != lo.stride():
        raise ValueError("the bounds need one layout with a contiguous head dim")
    if block % quest_page or (block // quest_page) & (block // quest_page - 1) or h % h_kv:
        raise ValueError(f"block {block} must be a power-of-two multiple of the Quest page {quest_page}")
    g_pad, sb = next_pow2(h // h_kv), block // quest_page
    dot = precision != "fma"
    m_def, pages_def, dk_def = _TILES["dot" if dot else "fma"]
    qt = rows if rows is not None else max(1, m_def // g_pad)
    pages, dk = pages or pages_def, dk or dk_def
    for name, x in (("rows", qt), ("pages", pages), ("dk", dk)):
        if x < 1 or x & (x - 1):
            raise ValueError(f"{name} must be a power of two, got {x}")
    n_rows = row_seq.numel()
    out = torch.empty(h_kv, n_rows, nkb, dtype=torch.float32, device=q.device)
    if not out.numel():
        return out
    cu, seqlens, table = cu_q.to(torch.int32), seqlens.to(torch.int32), page_table.to(torch.int32)
    row_seq, row_qb = row_seq.to(torch.int32), row_qb.to(torch.int32)
    qmean = torch.empty(n_rows, h, d, dtype=torch.float32, device=q.device)
    _mean_kernel[(n_rows, h)](q, cu, seqlens, row_seq, row_qb, qmean, q.stride(0), q.stride(1), qmean.stride(0),
                              qmean.stride(1), d, BLOCK=block, TB=min(block, 32), D_PAD=next_pow2(d), num_warps=4)
    kbt = max(1, pages // sb)
    _score_kernel[(-(-nkb // kbt), -(-n_rows // qt), h_kv)](
        qmean, lo, hi, table, seqlens, row_seq, row_qb, out, n_rows, nkb, d, qmean.stride(0), qmean.stride(1),
        lo.stride(0), lo.stride(1), lo.stride(2), table.stride(0), out.stride(0), out.stride(1), QPAGE=quest_page,
        S=sub, SB=sb, G=h // h_kv, G_PAD=g_pad, QT=qt, KBT=kbt, DK=min(dk, next_pow2(d)), DOT=dot,
        PREC=precision if dot else "ieee", num_warps=num_warps)
    return out
