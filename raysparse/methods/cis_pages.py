"""CIS's page retrieval (``CISConfig.retrieval = "pages"``): a retrieving (KV head, step) pair ranks pages by Quest's
upper bound instead of scoring every key, then scores exact keys within the top pages only.

The rule, for a pair with n keys, candidates [a, b) (a = max(C_sink, the PSAW window's bound), b = n - C_local) and
a top-k of k:

1. Pages: the Quest pages of ``retrieval_page`` tokens that hold a candidate ([j p, (j + 1) p) meets [a, b)), each
   scored by Quest's bound max_g sum_d max(q_g,d lo_d, q_g,d hi_d) over its keys' element-wise min lo and max hi
   (the group's g query heads reduced by max, as Quest's decode does); the top ``ceil(page_factor k / p)`` of them,
   ties to the lower page (``page_budget``).
2. Keys: every candidate inside those pages, ranked by its exact group-summed attention probability, where the
   softmax's normaliser spans the keys the step reads: those candidates plus the forced keys (the sinks, and the
   local window where visible), which the step attends anyway. The top-k of them, best first, ties to the lower
   index, is the retrieval's ranked S*.

Why exact keys inside the top pages rather than the top pages' tokens themselves: the spec's retrieval is a
token-level top-k ranked by attention weight, and CIS needs that order (the anchor's top-m are dilated and its set
is built in rank order, ``priority_set``), which whole pages have not; a page's tokens taken whole would also spend
the budget on its low-weight neighbours. Scoring the top pages' keys keeps S* token-exact wherever those pages
hold the oracle's top-k (the bound never under-scores a page), and ``page_factor`` > 1 leaves slack for pages the
bound over-scores. The normaliser differs from the oracle's (all n keys) only in the keys not read; with g = 1 it
does not change the ranking at all.

What a retrieval reads: the bounds (two d-vectors per page, an eighth of K at 16-token pages) plus the chosen
pages' and the forced keys, not all of K. The bounds live per physical page (``page_bounds.py``, Quest's state and
kernels: ``kernels/paged_quest.py`` scores them with ``forced=False``, since CIS's candidates need not include the
first and current pages that Quest forces).

``seq_pages_top`` is the per-sequence form (``cis.cis_step``'s, bounds from the gathered keys); ``paged_pages_top``
the batched one over the paged cache (``cis_batched``'s ranked path), in fixed shapes with no host read on GPUs
(every pair scored, the sharing ones discarded by the step) and only the retrieving pairs scored on a CPU.
"""

from __future__ import annotations

import math

import torch

from raysparse.kernels import dispatch
from raysparse.kernels.formats import PagedKV
from raysparse.kernels.paged_torch import stable_top
from raysparse.kernels.scorer_reference import page_bounds, page_upper_bound
from raysparse.methods.selection import SENTINEL


def seq_pages_top(q: torch.Tensor, k: torch.Tensor, a: int, b: int, forced: torch.Tensor, kk: int, pages: int,
                  page: int) -> torch.Tensor:
    """One sequence's page retrieval: q [h, d] (the newest position), k [h_kv, n, d], candidates [a, b), ``forced``
    [n] bool (the visible sinks and local window: read for the normaliser), top-``kk`` of the keys inside the best
    ``pages`` candidate pages of ``page`` tokens. Returns int64 [h_kv, kk], best first, SENTINEL-padded."""
    h_kv, n, d = k.shape
    g, dev = q.shape[0] // h_kv, k.device
    lo, hi = page_bounds(k, page)  # [h_kv, P, d]
    bound = page_upper_bound(q.float().view(h_kv, g, 1, d), lo, hi)[:, 0]  # [h_kv, P]
    j = torch.arange(lo.shape[1], device=dev)
    cand_page = (j * page < b) & ((j + 1) * page > a)
    ranked = torch.where(cand_page, bound, -math.inf).sort(dim=-1, descending=True, stable=True).indices[:, :pages]
    chosen = torch.zeros(h_kv, lo.shape[1], dtype=torch.bool, device=dev)
    chosen.scatter_(1, ranked, cand_page[ranked])
    pos = torch.arange(n, device=dev)
    cand = chosen.repeat_interleave(page, 1)[:, :n] & (pos >= a) & (pos < b)  # [h_kv, n]
    read = cand | forced
    logits = torch.einsum("hgd,hnd->hgn", q.float().view(h_kv, g, d), k.float()).div(math.sqrt(d))
    probs = logits.masked_fill(~read[:, None, :], -math.inf).softmax(-1).sum(1)
    order = torch.where(cand, probs, -math.inf).sort(dim=-1, descending=True, stable=True).indices[:, :kk]
    top = torch.where(cand.gather(-1, order), order, SENTINEL)
    return torch.nn.functional.pad(top, (0, kk - top.shape[-1]), value=SENTINEL) if top.shape[-1] < kk else top


def paged_pages_top(q: torch.Tensor, kv: PagedKV, bounds: tuple[torch.Tensor, torch.Tensor], wt: int, page: int,
                    a: torch.Tensor, b: torch.Tensor, sink: int, local: int, visible_lo: torch.Tensor | None,
                    k: int, k_rows: torch.Tensor, pages_w: int, pages_rows: torch.Tensor,
                    need: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``seq_pages_top`` of every (row, KV head) of a decode batch: q [B, h, d], the rows' paged keys ``kv`` and
    per-page bounds ``bounds`` (``page_bounds.bound_pools``), candidates [a, b) per row [B], the sinks and local
    window (visible from ``visible_lo`` [B], None: all) as forced keys, top-``k_rows`` [B] (<= k) of the keys in the
    best ``pages_rows`` [B] (<= pages_w) pages. ``need`` [B, h_kv] (None: all): the pairs that retrieve; the
    others get no valid entry. Returns indices [B, h_kv, k] best first and whether each is valid (``_retrieve``'s
    contract in ``cis_batched.py``)."""
    bsz, h, d = q.shape
    h_kv, cp = kv.k.shape[1], kv.k.shape[2]
    g, dev = h // h_kv, q.device
    n = kv.seqlens.long()
    score = dispatch.paged_quest_scores(q, bounds[0], bounds[1], kv.page_table, kv.seqlens, page, forced=False)
    score = score[..., : -(-wt // page)]  # [B, h_kv, pages]
    j = torch.arange(score.shape[-1], device=dev)
    cand_page = (j * page < b[:, None]) & ((j + 1) * page > a[:, None])  # [B, pages]
    ok_page = cand_page[:, None, :] if need is None else cand_page[:, None, :] & need[..., None]
    pidx, pok = stable_top(score, ok_page, max(min(pages_w, score.shape[-1]), 1))
    pok &= torch.arange(pidx.shape[-1], device=dev) < pages_rows[:, None, None]
    # Ascending pages, so the key columns below ascend and ``stable_top``'s ties go to the lower key.
    pidx = torch.where(pok, pidx, score.shape[-1]).sort(-1).values
    tok = (pidx[..., None] * page + torch.arange(page, device=dev)).flatten(-2)  # [B, h_kv, T]
    tok_ok = (tok >= a[:, None, None]) & (tok < b[:, None, None])
    # The forced keys, read for the normaliser: the sinks, then the local window's keys past the sinks (visible).
    sinks = torch.arange(min(sink, wt), device=dev).expand(bsz, -1)
    span = min(local, wt)
    loc = n[:, None] - span + torch.arange(span, device=dev)
    lo_vis = torch.zeros_like(n) if visible_lo is None else visible_lo.long()
    ftok = torch.cat([sinks, loc], 1)  # [B, F]
    fok = torch.cat([sinks < n[:, None], (loc >= sink) & (loc >= lo_vis[:, None])], 1)

    pairs = torch.arange(bsz * h_kv, device=dev)
    if need is not None and not q.is_cuda:  # a host read is free on a CPU: score the retrieving pairs alone
        pairs = need.flatten().nonzero().squeeze(1)
    bi, hi = pairs // h_kv, pairs % h_kv
    t_cand = tok.flatten(0, 1).index_select(0, pairs)
    c_ok = tok_ok.flatten(0, 1).index_select(0, pairs)
    all_tok = torch.cat([t_cand, ftok.index_select(0, bi)], 1)  # [P, T + F]
    all_ok = torch.cat([c_ok, fok.index_select(0, bi)], 1)
    safe = torch.where(all_ok, all_tok, 0)
    phys = kv.page_table.long()[bi[:, None], safe // cp]
    keys = kv.k.reshape(-1, d).index_select(0, ((phys * h_kv + hi[:, None]) * cp + safe % cp).flatten())
    qp = q.float().view(bsz * h_kv, g, d).index_select(0, pairs)
    logits = torch.bmm(qp, keys.view(len(pairs), -1, d).float().mT).div(math.sqrt(d))  # [P, g, T + F]
    probs = logits.masked_fill(~all_ok[:, None, :], -math.inf).softmax(-1).sum(1)[:, : t_cand.shape[1]]
    idx, ok = stable_top(probs, c_ok, k)
    order = t_cand.gather(1, idx)
    full_order = torch.zeros(bsz * h_kv, k, dtype=torch.long, device=dev)
    full_ok = torch.zeros(bsz * h_kv, k, dtype=torch.bool, device=dev)
    full_order[pairs, : idx.shape[1]] = order
    full_ok[pairs, : idx.shape[1]] = ok & (torch.arange(idx.shape[1], device=dev) < k_rows[bi][:, None])
    return full_order.view(bsz, h_kv, k), full_ok.view(bsz, h_kv, k)
