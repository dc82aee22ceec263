"""CIS's per-step bookkeeping around its selection, for a decode batch in fixed shapes: which pairs share an
anchor's set (``share``), the shared sets marked in the step's selection row (``mark_shared``), and the step's
anchors, counters and counts stored (``commit``). Each has a PyTorch form (the CPU path and the oracle) and
one Triton launch, where the PyTorch forms take 10 to 20 small launches each on a GPU step.

Layout (``CISRows`` of CIS's batched step, one sparse layer's views): ``cq`` fp32 [B, s, h_kv, g d]
the anchors' unit queries, ``sets`` int32 [B, s, h_kv, width] their sets, ``valid`` bool [B, s, h_kv],
``step`` int64 [B] the decode steps so far, ``counts`` int64 [B, h_kv, 2]; s anchor slots a row (CIS's sharing
block), each pair (b, h) of row and KV head keeps its own. A step's slot is ``step % s``.

- ``share(q, cq, valid, step, threshold)``: clears ``valid`` of the rows whose step opens a block (slot 0),
  then per pair the unit query of its group (q [B, h, d] as [B, h_kv, g d], by its norm) and the most recent
  slot with a valid anchor whose cosine with it is above ``threshold``. Returns (qn fp32 [B, h_kv, g d],
  chosen int64 [B, h_kv], -1 where none: that pair retrieves).
- ``mark_shared(final, sets, chosen, n, lo, sink)``: for every pair that shares, its chosen set's keys that
  the row sees (below n, a sink or at or past ``lo``) become +inf in ``final`` [B h_kv, W] (in place; those
  positions hold 0 or +inf there, so the +inf ``cis_listed`` added is the same value).
- ``commit(cq, sets, valid, step, counts, qn, new_set, chosen, out)``: a retrieving pair's query and new set
  become its slot's anchor, every pair's slot is valid where it retrieved, ``step`` advances, and ``counts``
  gets each pair's keys attended (``out`` [B, h_kv, W] entries >= 0) and whether it retrieved.
"""

from __future__ import annotations

import torch

from .common import next_pow2, tl, triton
from .kernel_path import triton_wanted
from .paged_torch import in_window

_TINY = torch.finfo(torch.float32).tiny


def share_torch(q: torch.Tensor, cq: torch.Tensor, valid: torch.Tensor, step: torch.Tensor,
                threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    b, s, h_kv, qdim = cq.shape
    valid.masked_fill_((step % s == 0)[:, None, None], False)  # a block's first step has no anchor to share
    qg = q.float().reshape(b, h_kv, qdim)
    qn = qg / qg.norm(dim=-1, keepdim=True).clamp(min=_TINY)
    cos = (cq * qn[:, None]).sum(-1)  # [B, s, h_kv]
    slots = torch.arange(s, device=q.device)[None, :, None]
    return qn, torch.where(valid & (cos > threshold), slots, -1).amax(1)


def mark_shared_torch(final: torch.Tensor, sets: torch.Tensor, chosen: torch.Tensor, n: torch.Tensor,
                      lo: torch.Tensor, sink: int) -> None:
    b, h_kv = chosen.shape
    wt = final.shape[1]
    rows, heads = torch.arange(b, device=sets.device), torch.arange(h_kv, device=sets.device)
    idx = sets[rows[:, None], chosen.clamp(min=0), heads[None, :]].long()  # [B, h_kv, width]
    seen = (idx >= 0) & (idx < n[:, None, None]) & (chosen >= 0)[..., None] & in_window(idx, lo[:, None, None], sink)
    # Adding +inf marks a set's key wherever it lands (0, a forced +inf; a column given twice stays +inf),
    # adding 0 changes nothing: so the entries that are not seen (most are padding) may land anywhere, and
    # they are spread over the columns by their slot, where one column for all of them serialised the atomic
    # adds (37 us a layer at 4 x 32K on an H200).
    spread = torch.arange(idx.shape[-1], device=idx.device) % wt
    final.scatter_add_(1, torch.where(seen, idx, spread).flatten(0, 1),
                       torch.where(seen, float("inf"), 0.0).flatten(0, 1))


def commit_torch(cq: torch.Tensor, sets: torch.Tensor, valid: torch.Tensor, step: torch.Tensor,
                 counts: torch.Tensor, qn: torch.Tensor, new_set: torch.Tensor | None, chosen: torch.Tensor,
                 out: torch.Tensor) -> None:
    """``new_set`` None: no pair retrieved (a CPU step that checked), so no anchor changes."""
    b, s = cq.shape[:2]
    rows, slot = torch.arange(b, device=cq.device), step % s
    here = chosen < 0
    if new_set is not None:
        cq[rows, slot] = torch.where(here[..., None], qn, cq[rows, slot])
        sets[rows, slot] = torch.where(here[..., None], new_set, sets[rows, slot])
    valid[rows, slot] = here
    step.add_(1)
    counts.copy_(torch.stack([(out >= 0).sum(-1), here.long()], -1))


if triton is not None:

    @triton.jit
    def _share_kernel(Q, CQ, V, STEP, QN, CH, H_KV, thr, s_qb, s_qh, s_cb, s_cs, s_ch, s_vb, s_vs,
                      S: tl.constexpr, SP: tl.constexpr, G: tl.constexpr, D: tl.constexpr, GDP: tl.constexpr):
        p = tl.program_id(0)
        b = p // H_KV
        h = p % H_KV
        e = tl.arange(0, GDP)  # the group's g d entries, padded to a power of two (g = 3 on the default model)
        em = e < G * D
        j = tl.arange(0, SP)
        first = tl.load(STEP + b) % S == 0
        v_at = V + b * s_vb + j * s_vs + h
        v = tl.load(v_at, mask=j < S, other=0) != 0
        v = v & ~first
        tl.store(v_at, v.to(tl.int8), mask=(j < S) & first)
        qg = tl.load(Q + b * s_qb + (h * G + e // D) * s_qh + e % D, mask=em, other=0.0).to(tl.float32)
        qn = qg / tl.maximum(tl.sqrt(tl.sum(qg * qg, 0)), 1.1754943508222875e-38)
        a = tl.load(CQ + b * s_cb + j[:, None] * s_cs + h * s_ch + e[None, :], mask=(j < S)[:, None] & em[None, :],
                    other=0.0)
        cos = tl.sum(a * qn[None, :], 1)
        tl.store(QN + p * (G * D) + e, qn, mask=em)
        tl.store(CH + p, tl.max(tl.where(v & (cos > thr), j, -1), 0).to(tl.int64))

    @triton.jit
    def _mark_kernel(F, SETS, CH, N, LO, sink, WT, WIDTH, H_KV, s_sb, s_ss, s_sh, BLK: tl.constexpr):
        p = tl.program_id(0)
        ch = tl.load(CH + p)
        if ch >= 0:  # a sharing pair (one that retrieves has no set to mark)
            b = p // H_KV
            cols = tl.program_id(1) * BLK + tl.arange(0, BLK)
            idx = tl.load(SETS + b * s_sb + ch * s_ss + (p % H_KV) * s_sh + cols, mask=cols < WIDTH, other=-1)
            seen = (idx >= 0) & (idx < tl.load(N + b)) & ((idx < sink) | (idx >= tl.load(LO + b)))
            tl.store(F + p.to(tl.int64) * WT + idx, float("inf"), mask=seen)

    @triton.jit
    def _commit_kernel(CQ, SETS, V, STEP, CNT, QN, NEW, CH, OUT, H_KV, WIDTH, OW, s_cb, s_cs, s_ch,
                       s_sb, s_ss, s_sh, s_vb, s_vs, S: tl.constexpr, GD: tl.constexpr, GDP: tl.constexpr,
                       BLK: tl.constexpr):
        p = tl.program_id(0)  # a (row, KV head) pair: no program reads what another writes
        b = p // H_KV
        h = p % H_KV
        slot = tl.load(STEP + b) % S
        here = tl.load(CH + p) < 0
        c = tl.arange(0, BLK)
        if here:
            e = tl.arange(0, GDP)
            tl.store(CQ + b * s_cb + slot * s_cs + h * s_ch + e, tl.load(QN + p * GD + e, mask=e < GD), mask=e < GD)
            for c0 in range(0, WIDTH, BLK):
                tl.store(SETS + b * s_sb + slot * s_ss + h * s_sh + c0 + c,
                         tl.load(NEW + p * WIDTH + c0 + c, mask=c0 + c < WIDTH), mask=c0 + c < WIDTH)
        tl.store(V + b * s_vb + slot * s_vs + h, here.to(tl.int8))
        keys = tl.zeros([BLK], dtype=tl.int64)
        for c0 in range(0, OW, BLK):
            keys += (tl.load(OUT + p.to(tl.int64) * OW + c0 + c, mask=c0 + c < OW, other=-1) >= 0).to(tl.int64)
        tl.store(CNT + p * 2, tl.sum(keys, 0))
        tl.store(CNT + p * 2 + 1, here.to(tl.int64))


def share_triton(q: torch.Tensor, cq: torch.Tensor, valid: torch.Tensor, step: torch.Tensor,
                 threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``share`` in one launch, a program per pair (``share``'s shape checks passed)."""
    b, s, h_kv, qdim = cq.shape
    qn = torch.empty(b, h_kv, qdim, dtype=torch.float32, device=q.device)
    chosen = torch.empty(b, h_kv, dtype=torch.int64, device=q.device)
    if b:
        _share_kernel[(b * h_kv,)](q, cq, valid.view(torch.int8), step, qn, chosen, h_kv, float(threshold),
                                   q.stride(0), q.stride(1), cq.stride(0), cq.stride(1), cq.stride(2),
                                   valid.stride(0), valid.stride(1), S=s, SP=next_pow2(s), G=q.shape[1] // h_kv,
                                   D=q.shape[-1], GDP=next_pow2(qdim))
    return qn, chosen


def share(q: torch.Tensor, cq: torch.Tensor, valid: torch.Tensor, step: torch.Tensor,
          threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's ``share`` (see its docstring): one launch where Triton runs."""
    if triton_wanted(q, cq) and cq.stride(-1) == 1 and q.stride(-1) == 1 and valid.dtype == torch.bool:
        return share_triton(q, cq, valid, step, threshold)
    return share_torch(q, cq, valid, step, threshold)


def mark_shared_triton(final: torch.Tensor, sets: torch.Tensor, chosen: torch.Tensor, n: torch.Tensor,
                       lo: torch.Tensor, sink: int) -> None:
    """``mark_shared`` in one launch, a program per pair and 1024 set entries."""
    b, h_kv = chosen.shape
    width, blk = sets.shape[-1], 1024
    if b and width:
        _mark_kernel[(b * h_kv, -(-width // blk))](final, sets, chosen.contiguous(), n.contiguous(), lo.contiguous(),
                                                   sink, final.shape[1], width, h_kv, sets.stride(0),
                                                   sets.stride(1), sets.stride(2), BLK=blk)


def mark_shared(final: torch.Tensor, sets: torch.Tensor, chosen: torch.Tensor, n: torch.Tensor, lo: torch.Tensor,
                sink: int) -> None:
    """The module's ``mark_shared``: one launch where Triton runs."""
    if triton_wanted(final, sets) and sets.stride(-1) == 1 and final.is_contiguous():
        mark_shared_triton(final, sets, chosen, n, lo, sink)
    else:
        mark_shared_torch(final, sets, chosen, n, lo, sink)


def commit_triton(cq: torch.Tensor, sets: torch.Tensor, valid: torch.Tensor, step: torch.Tensor,
                  counts: torch.Tensor, qn: torch.Tensor, new_set: torch.Tensor, chosen: torch.Tensor,
                  out: torch.Tensor) -> None:
    """``commit`` in one launch, a program per pair, then the rows' step counters (one more: every pair of a
    row reads the counter for its slot, so none of them may advance it)."""
    b, s, h_kv, qdim = cq.shape
    if b:
        _commit_kernel[(b * h_kv,)](cq, sets, valid.view(torch.int8), step, counts, qn.contiguous(),
                                    new_set.contiguous(), chosen.contiguous(), out.contiguous(), h_kv,
                                    new_set.shape[-1], out.shape[-1], cq.stride(0), cq.stride(1), cq.stride(2),
                                    sets.stride(0), sets.stride(1), sets.stride(2), valid.stride(0), valid.stride(1),
                                    S=s, GD=qdim, GDP=next_pow2(qdim), BLK=1024)
    step.add_(1)


def commit(cq: torch.Tensor, sets: torch.Tensor, valid: torch.Tensor, step: torch.Tensor, counts: torch.Tensor,
           qn: torch.Tensor, new_set: torch.Tensor | None, chosen: torch.Tensor, out: torch.Tensor) -> None:
    """The module's ``commit``: two launches where Triton runs. ``new_set`` None: no pair retrieved (only a
    CPU step knows that without a host read), so no anchor changes."""
    if (new_set is not None and triton_wanted(cq, sets) and cq.stride(-1) == 1 and sets.stride(-1) == 1
            and valid.dtype == torch.bool and counts.is_contiguous() and step.is_contiguous()):
        commit_triton(cq, sets, valid, step, counts, qn, new_set, chosen, out)
    else:
        commit_torch(cq, sets, valid, step, counts, qn, new_set, chosen, out)
