"""CIS's new anchor sets from the step's own list, one pass per (row, KV head) pair: ``anchor_sets``.

Inputs (CIS's listed step, ``cis_listed``, builds them): ``listed`` int32 [R, OW], each pair's step list
(ascending columns, -1 after); ``final`` fp32 [R, W], the step's selection row, whose entries at a retrieving
pair's candidates (columns in [lo, hi) of its row) are the retrieval's probabilities; ``lo``, ``hi`` [B] the
candidates' bounds per batch row (R = B * h_kv pairs, row-major); ``here`` [B, h_kv] bool, the pairs that
retrieve; ``pair_m``, ``pair_k``, ``pair_n`` [R] the top-m count, the set's limit k and the row's length n.

A retrieving pair's set: the top-m of its listed candidates by probability (ties to the lower column) are the
leads; N is their +-``radius`` neighbours in [0, n); then the k - |N| best listed candidates outside N. Stored
as the others ascending, then N lead by lead (each lead's columns in the order lead, lead - r .. lead - 1,
lead + 1 .. lead + r, a column already in the previous lead's interval dropped), SENTINEL after, truncated to
``width``. A pair that does not retrieve gets an empty set. Output int32 [R, width].

``anchor_sets_torch`` is the reference (the CPU path, and the GPU's for lists longer than the one-program
bound): two ``select_list`` calls and about twenty PyTorch ops over [R, OW]. ``anchor_sets_triton`` is one
launch with one program per pair that holds the pair's list in registers (up to ``row_select.SINGLE_MAX``
entries): the two top-counts by ``kth_key`` bisection as ``select_list``'s one-program path finds them, the
leads' previous and next columns by scans, and the writes at ``tl.cumsum`` positions. Both give the same
entries in the same order (``tests/test_anchor_sets.py``).
"""

from __future__ import annotations

import torch

from .common import int8_flags, kth_key, next_pow2, take_at_threshold, tl, triton
from .kernel_path import triton_wanted
from .row_select import SINGLE_MAX, select_list
from .selection import SENTINEL

_FAR = 2**30  # a column past any row (the padding's lead)


def dilation_offsets(radius: int, device: torch.device) -> torch.Tensor:
    """A lead's neighbours relative to it, in CIS's order: -r .. -1, 1 .. r (int64 [2 r])."""
    j = torch.arange(2 * radius, device=device)
    return j - radius + (j >= radius).long()


def anchor_sets_torch(listed: torch.Tensor, final: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                      here: torch.Tensor, pair_m: torch.Tensor, pair_k: torch.Tensor, pair_n: torch.Tensor,
                      m_w: int, k_w: int, radius: int, width: int) -> torch.Tensor:
    """The module's contract in PyTorch ops with fixed shapes (capturable)."""
    b, h_kv = here.shape
    inf = float("inf")
    lst = listed.long()
    lv = lst.view(b, h_kv, -1)
    # A retrieving pair's listed candidates keep their probabilities; its forced keys, and every entry of a
    # pair that does not retrieve, score -inf.
    cand_at = ((lv >= lo[:, None, None]) & (lv < hi[:, None, None]) & here[..., None]).flatten(0, 1)
    pick = torch.where(cand_at, final.gather(1, lst.clamp(min=0)), -inf)
    # One spare column, so every row ends in padding, which is moved past every column: the leads stay
    # sorted for the search below, and its neighbours fall past n like those of no lead.
    lead = select_list(pick, pair_m, m_w, m_w + 1).long()
    lead = torch.where(lead >= 0, lst.gather(1, lead.clamp(min=0)), _FAR)  # ascending, distinct
    r = radius
    nb = torch.cat([lead[..., None], lead[..., None] + dilation_offsets(r, lst.device)], -1)  # [R, m + 1, 1 + 2 r]
    # A neighbour inside the previous lead's interval is a repeat (the earlier ones end below it); the first
    # lead's "previous" interval ends at -1, so that test also drops neighbours below 0.
    prev_end = torch.nn.functional.pad(lead[:, :-1] + r, (1, 0), value=-1)
    fresh = ((nb > prev_end[..., None]) & (nb < pair_n[:, None, None])).flatten(1)
    nb = nb.flatten(1)
    # A listed column c is in N when the first lead at or past c - r is at most c + r (the padding ends every
    # row, so there is one).
    in_n = lead.gather(1, torch.searchsorted(lead, lst - r)) - lst <= r
    score = torch.cat([torch.where(in_n, -inf, pick), torch.where(fresh, inf, -inf).to(pick.dtype)], 1)
    pos = select_list(score, pair_k - fresh.sum(1), k_w, width).long()
    new_set = torch.where(pos >= 0, torch.cat([lst, nb], 1).gather(1, pos.clamp(min=0)), SENTINEL)
    return new_set.to(torch.int32)


if triton is not None:
    from .row_select_kernels import _keys

    @triton.jit
    def _top2(a1, a2, b1, b2):
        """The two largest of two (largest, second) pairs: a prefix scan's running lead and the one before."""
        return tl.maximum(a1, b1), tl.maximum(tl.minimum(a1, b1), tl.maximum(a2, b2))

    @triton.jit
    def _least(a, b):
        return tl.minimum(a, b)

    @triton.jit
    def _offset(j: tl.constexpr, R: tl.constexpr):
        """The j-th of a lead's columns, relative to it: 0, then ``dilation_offsets``' -R .. -1, 1 .. R."""
        if j == 0:
            return 0
        elif j <= R:
            return j - 1 - R
        else:
            return j - R

    @triton.jit
    def _anchor_kernel(L, F, LO, HI, HERE, PM, PK, PN, OUT, OW, WT, H_KV, M_W, K_W, WIDTH,
                       NP: tl.constexpr, R: tl.constexpr, PB: tl.constexpr):
        p = tl.program_id(0)
        row = OUT + p.to(tl.int64) * WIDTH
        end = p * 0  # the set's length: 0 where the pair does not retrieve (it shares)
        if tl.load(HERE + p) != 0:  # a sharing pair (most, in a model whose queries repeat) only pads
            b = p // H_KV
            cols = tl.arange(0, NP)
            valid = cols < OW
            lst = tl.load(L + p.to(tl.int64) * OW + cols, mask=valid, other=-1)
            n = tl.load(PN + p)
            cand = valid & (lst >= tl.load(LO + b)) & (lst < tl.load(HI + b))
            pick = tl.load(F + p.to(tl.int64) * WT + lst, mask=cand, other=float("-inf"))
            key = tl.where(cand, _keys(pick), -2147483648)
            none = cols < 0
            # The leads: the top-m candidates, ties to the lower column (the list ascends).
            ncand = tl.sum(cand.to(tl.int32), 0)
            m = tl.minimum(tl.minimum(tl.maximum(tl.load(PM + p), 0), M_W), ncand).to(tl.int32)
            lead, _, _ = take_at_threshold(cand, key, kth_key(cand, key, m, ncand).to(tl.int32), m, none)
            is_lead = lead != 0
            col = lst  # int32: a program holds ~10 lists in registers, which int64 would spill
            # Per entry: the last lead at or before it and the one before that (prefix scan), and the first lead
            # at or after it (suffix scan).
            far = tl.full([NP], -1073741824, tl.int32)  # -_FAR (a jit'ed function reads no Python global)
            last, before = tl.associative_scan((tl.where(is_lead, col, far), far), 0, _top2)
            nxt = tl.associative_scan(tl.where(is_lead, col, -far), 0, _least, reverse=True)
            in_n = (col - last <= R) | (nxt - col <= R)
            # N lead by lead: the lead's 1 + 2 r columns past the previous lead's interval and below n.
            prev_end = tl.where(before > far, before + R, -1)
            cnt = tl.zeros([NP], dtype=tl.int32)
            for j in tl.static_range(2 * R + 1):
                x = col + _offset(j, R)
                cnt += (is_lead & (x > prev_end) & (x < n)).to(tl.int32)
            n_n = tl.sum(cnt, 0)
            # The others: the k - |N| best candidates outside N.
            other = cand & ~in_n
            okey = tl.where(other, key, -2147483648)
            nother = tl.sum(other.to(tl.int32), 0)
            k = tl.minimum(tl.minimum(tl.maximum(tl.load(PK + p) - n_n, 0), K_W), nother).to(tl.int32)
            take, pos, total = take_at_threshold(other, okey, kth_key(other, okey, k, nother).to(tl.int32), k, none)
            tl.store(row + pos, lst, mask=(take > 0) & (pos < WIDTH))
            at = total + tl.cumsum(cnt, 0) - cnt  # each lead's first slot
            for j in tl.static_range(2 * R + 1):
                x = col + _offset(j, R)
                f = is_lead & (x > prev_end) & (x < n)
                tl.store(row + at, x, mask=f & (at < WIDTH))
                at += f.to(tl.int32)
            end = total + n_n
        for p0 in range(0, WIDTH, PB):
            q = p0 + tl.arange(0, PB)
            tl.store(row + q, tl.full([PB], -1, tl.int32), mask=(q < WIDTH) & (q >= end))


def anchor_sets_triton(listed: torch.Tensor, final: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                       here: torch.Tensor, pair_m: torch.Tensor, pair_k: torch.Tensor, pair_n: torch.Tensor,
                       m_w: int, k_w: int, radius: int, width: int, num_warps: int | None = None) -> torch.Tensor:
    """The contract in one launch; lists of at most ``SINGLE_MAX`` entries (the caller checks). ``num_warps``
    is a tuning knob for ``benchmarks/bench_anchor_sets.py`` (None: by the list's length)."""
    rows, ow = listed.shape
    out = torch.empty(rows, width, dtype=torch.int32, device=listed.device)
    if rows == 0 or width == 0:
        return out
    np_ = next_pow2(max(ow, 1))
    # Warps by the list's length (8 to 16 entries a thread): at 4 x 32K (~3.3K entries) 16 warps took 36 us, 8
    # warps 45 and 4 warps 79 (H200, ``bench_anchor_sets.py``); 32 were slower again (48 us).
    # The kernels read every per-row value at its offset: broadcast views (stride 0) would not be.
    args = [x.contiguous() for x in (listed, final, lo, hi, int8_flags(here), pair_m, pair_k, pair_n)]
    _anchor_kernel[(rows,)](*args, out, ow, final.shape[1], here.shape[1], m_w, k_w, width, NP=np_, R=radius,
                            PB=min(1024, next_pow2(width)), num_warps=num_warps or min(16, max(4, np_ // 256)))
    return out


def anchor_sets(listed: torch.Tensor, final: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, here: torch.Tensor,
                pair_m: torch.Tensor, pair_k: torch.Tensor, pair_n: torch.Tensor, m_w: int, k_w: int, radius: int,
                width: int) -> torch.Tensor:
    """The module's contract: Triton where it runs (``dispatch.triton_wanted``) and the lists fit one program,
    else the PyTorch form."""
    if triton_wanted(listed, final) and listed.shape[1] <= SINGLE_MAX:
        return anchor_sets_triton(listed, final, lo, hi, here, pair_m, pair_k, pair_n, m_w, k_w, radius, width)
    return anchor_sets_torch(listed, final, lo, hi, here, pair_m, pair_k, pair_n, m_w, k_w, radius, width)
