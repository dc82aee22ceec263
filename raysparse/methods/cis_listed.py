"""CIS's batched step by list selections: the retrieval, the anchor sets and the step's selection as three
exact ``select_list`` calls, for sets limited to k with m = k // (3 + 2 r) (a density, no ``top_m``).

There the priority list's first k distinct entries (``cis.priority_set``) are N, the top-m with their +-r
neighbours in [0, n), followed by the best-ranked candidates outside N up to k: |N| <= m (1 + 2 r) < k, and
the ranked top-k holds at least k - |N| entries outside N. So a set is N forced (+inf) plus the k - |N| best
others, one selection, and the sorted top-k, the int64 sort keys and the cumulative sums of ``priority_set``
and ``compact`` (the most of a GPU step) are not needed. The ranking is ``stable_top``'s: score descending,
column ascending on ties. The lists come out ascending, so stored sets are ascending too.

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

if TYPE_CHECKING:
    from raysparse.methods.cis_batched import CISStepConsts


def listed_select(c: CISStepConsts, q: torch.Tensor, kv: PagedKV, wt: int, allowed: torch.Tensor,
                  visible: torch.Tensor, forced: torch.Tensor, here: torch.Tensor, shared_mask: torch.Tensor,
                  width: int, out_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The retrieving pairs' new anchor sets, int32 [B, h_kv, width] ascending (-1 after), and the step's
    selection, int32 [B, h_kv, out_width]. ``allowed`` [B, W]: the retrieval's candidates; ``visible`` and
    ``forced`` [B, W]; ``here`` [B, h_kv]: the pairs that retrieve (the others share); ``shared_mask``
    [B, h_kv, W]: each pair's shared anchor set as a mask. Fixed shapes, no host read, no host tensor."""
    b, h_kv = here.shape
    inf = float("inf")  # a Python scalar: a tensor made here would be a host copy inside a graph capture
    score = dispatch.paged_group_probs(q, kv, wt, here)  # [B, h_kv, W]; pairs that share read no key
    cand = torch.where(allowed[:, None, :] & here[..., None], score, -inf).flatten(0, 1)
    # The anchors' sets: N from the top-m, then N forced plus the best others up to k.
    lead = select_list(cand.contiguous(), c.pair_m, c.m_w, max(c.m_w, 1)).long()
    nb = torch.cat([lead[..., None], lead[..., None] + c.offs], -1)  # [R, m, 1 + 2 r]
    ok = (lead >= 0)[..., None] & (nb >= 0) & (nb < c.pair_n[:, None, None])
    hood = torch.zeros(b * h_kv, wt + 1, dtype=torch.bool, device=q.device)
    hood = hood.scatter_(-1, torch.where(ok, nb, wt).flatten(1), True)[:, :wt]
    new_set = select_list(torch.where(hood, inf, cand).contiguous(), c.pair_k - hood.sum(-1), c.k_w, width)
    # The step: forced keys, plus the retrieval's top-k (no dilation on its own step) or the shared set.
    listed = forced[:, None, :] | (shared_mask & ~here[..., None] & visible[:, None, :])
    final = torch.where(listed.flatten(0, 1), inf, cand)
    out = select_list(final.contiguous(), torch.where(here.flatten(), c.pair_k, 0), c.k_w, out_width)
    return new_set.view(b, h_kv, width), out.view(b, h_kv, -1)
