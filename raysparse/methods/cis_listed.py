"""CIS's batched step by list selections: the retrieval, the anchor sets and the step's selection as three
exact ``select_list`` calls, for sets limited to k with m = k // (3 + 2 r) (a density, no ``top_m``).

There the priority list's first k distinct entries (``cis.priority_set``) are N, the top-m with their +-r
neighbours in [0, n), followed by the best-ranked candidates outside N up to k: |N| <= m (1 + 2 r) < k, and
the ranked top-k holds at least k - |N| entries outside N. So a set is N forced (+inf) plus the k - |N| best
others, one selection, and the sorted top-k, the int64 sort keys and the cumulative sums of ``priority_set``
and ``compact`` (the most of a GPU step) are not needed. The ranking is ``stable_top``'s: score descending,
column ascending on ties. The lists come out ascending, so stored sets are ascending too.

Every pass over the [B h_kv, W] rows costs on a GPU step, so the rows are built with few: the scorer writes
the candidate row itself (probabilities inside [max(sink, lo), n - local), -inf elsewhere), the step's list
comes first (forced keys and the shared set scattered in as +inf, then the top-k), the top-m is taken from
that list's own entries (a list of ~k, not W: the top-m of the candidates lie in their top-k, and the list is
ascending, so ties still break by column), and N's +inf go into one copy of the candidate row.

``cis_batched.cis_batched_step`` runs it where ``select_list`` runs on Triton (GPUs); on a CPU its three
top-k passes over every key cost more than the ranked path's sort and cumulative sums, so the CPU keeps
those (``tests/test_cpu_paths.py`` holds the two paths equal).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from raysparse.kernels import dispatch
from raysparse.kernels.formats import PagedKV
from raysparse.kernels.row_select import select_list

_INF = float("inf")  # a Python scalar: a tensor made inside the step would be a host copy in a graph capture

if TYPE_CHECKING:
    from raysparse.methods.cis import CISConfig
    from raysparse.methods.cis_batched import CISStepConsts


def listed_select(cfg: CISConfig, c: CISStepConsts, q: torch.Tensor, kv: PagedKV, wt: int,
                  visible_lo: torch.Tensor | None, here: torch.Tensor, shared: torch.Tensor, width: int,
                  out_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The retrieving pairs' new anchor sets, int32 [B, h_kv, width] (-1 after), and the step's selection,
    int32 [B, h_kv, out_width] ascending. ``visible_lo`` [B]: the lowest visible non-sink key per row (PSAW
    in CPE; None: every key); ``here`` [B, h_kv]: the pairs that retrieve (the others share); ``shared``
    [B, h_kv, width]: each pair's shared anchor set (SENTINEL-padded). Fixed shapes, no host read."""
    b, h_kv = here.shape
    n = c.n
    lo = n.new_full(n.shape, cfg.sink) if visible_lo is None else visible_lo.long().clamp(min=cfg.sink)
    cand = dispatch.paged_group_probs(q, kv, wt, here, (lo, n - cfg.local)).view(b * h_kv, wt)
    # The step: the forced keys (sinks, and the local window where visible) and, for sharing pairs, their
    # set's visible keys as +inf; retrieving pairs add their top-k of the candidates (sharing ones' are -inf).
    near = torch.arange(cfg.local, device=n.device)  # not c.pos[:local]: a bucket may be narrower
    cols = torch.cat([c.pos[: cfg.sink].expand(b, -1), n[:, None] - cfg.local + near], 1)
    # Visible: a sink, or at or past lo (which is the sink count when every key is visible).
    vis = (cols >= 0) & (cols < n[:, None]) & ((cols < cfg.sink) | (cols >= lo[:, None]))
    idx = shared.long()
    seen = (idx >= 0) & (idx < n[:, None, None]) & ~here[..., None]
    seen &= (idx < cfg.sink) | (idx >= lo[:, None, None])
    idx = torch.cat([cols[:, None, :].expand(-1, h_kv, -1), idx], -1).flatten(0, 1)
    ok = torch.cat([vis[:, None, :].expand(-1, h_kv, -1), seen], -1).flatten(0, 1)
    final = _plus_inf(cand, idx, ok)
    out = select_list(final, torch.where(here.flatten(), c.pair_k, 0), c.k_w, out_width)
    # The anchors' sets: the top-m from the step's list (its candidates are the top-k), their +-r
    # neighbours in [0, n) as N (+inf), then the k - |N| best others.
    listed = out.long()
    pick = torch.where(listed >= 0, cand.gather(1, listed.clamp(min=0)), -_INF)
    lead = select_list(pick, c.pair_m, c.m_w, max(c.m_w, 1)).long()
    lead = torch.where(lead >= 0, listed.gather(1, lead.clamp(min=0)), -1)
    nb = torch.cat([lead[..., None], lead[..., None] + c.offs], -1)  # [R, m, 1 + 2 r]
    ok = (lead >= 0)[..., None] & (nb >= 0) & (nb < c.pair_n[:, None, None])
    hood = _plus_inf(cand, nb.flatten(1), ok.flatten(1))
    new_set = select_list(hood, c.pair_k - torch.isposinf(hood).sum(-1), c.k_w, width)
    return new_set.view(b, h_kv, width), out.view(b, h_kv, -1)


def _plus_inf(row: torch.Tensor, idx: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """A copy of ``row`` [R, W] with +inf at the columns ``idx`` [R, K] where ``ok`` (the others untouched;
    repeated columns are fine: a max)."""
    src = torch.where(ok, _INF, -_INF).to(row.dtype)
    return row.clone().scatter_reduce_(1, idx.clamp(0, row.shape[1] - 1), src, "amax")

