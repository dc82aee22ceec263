"""CIS's batched step by list selections: the retrieval, the anchor sets and the step's selection as three
exact ``select_list`` calls, for sets limited to k with m = k // (3 + 2 r) (a density, no ``top_m``).

There the priority list's first k distinct entries (``cis.priority_set``) are N, the top-m with their +-r
neighbours in [0, n), followed by the best-ranked candidates outside N up to k: |N| <= m (1 + 2 r) < k, and
the ranked top-k holds at least k - |N| entries outside N. So a set is N forced (+inf) plus the k - |N| best
others, one selection, and the sorted top-k, the int64 sort keys and the cumulative sums of ``priority_set``
and ``compact`` (the most of a GPU step) are not needed. The ranking is ``stable_top``'s: score descending,
column ascending on ties.

Every pass over the [B h_kv, W] rows costs on a GPU step, so the rows are built with few and only the step's list
selects over them: the scorer writes the step's selection row itself (probabilities inside [max(sink, lo), n -
local), the forced keys +inf, -inf elsewhere; a sharing pair's set is added in as +inf in place), the step's list
comes first (the forced keys and the shared set, then the top-k T), and the anchors' sets come from that list's
entries, ~k wide, not W. Exact: T's entries are the list's candidates, the top-m lies in T, and the j-th best
candidate outside N has at most |N| of N above it (its rank is at most j + |N|), so the k - |N| best outside N all
lie in T. The list is ascending, so list order is column order and ties still break by column. The sets' selection
row is the list's candidates not in N (a lead within r, by a binary search in the ascending leads), then N as +inf
(each lead's 1 + 2 r columns, a repeat dropped when the previous lead's interval holds it: the leads ascend, so no
earlier one reaches further). Stored sets hold the listed others ascending, then N, SENTINEL after: not ascending,
as the ranked path's priority order is not.

The anchors' sets are ``kernels.anchor_sets``'s: one launch on GPUs (one program per pair holds its list), where
this took two more list selections and about twenty small PyTorch launches over [B h_kv, ~k]. Lists longer than
that program holds (``row_select.SINGLE_MAX`` entries: a tenth of more than about 80K keys) still take that
PyTorch form, about half of the selection's time at 131072 keys (BENCHMARKS.md).

``cis_batched.cis_batched_step`` runs it where ``select_list`` runs on Triton (GPUs); on a CPU its top-k
passes cost more than the ranked path's sort and cumulative sums, so the CPU keeps those
(``tests/test_cpu_paths.py`` holds the two paths equal).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from raysparse.kernels import dispatch
from raysparse.kernels.formats import PagedKV

if TYPE_CHECKING:
    from raysparse.methods.cis import CISConfig, CISStepConsts


def listed_select(cfg: CISConfig, c: CISStepConsts, q: torch.Tensor, kv: PagedKV, wt: int,
                  visible_lo: torch.Tensor | None, here: torch.Tensor, sets: torch.Tensor, chosen: torch.Tensor,
                  width: int, out_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The retrieving pairs' new anchor sets, int32 [B, h_kv, width] (-1 after), and the step's selection,
    int32 [B, h_kv, out_width] ascending. ``visible_lo`` [B]: the lowest visible non-sink key per row (PSAW
    in CPE; None: every key); ``here`` [B, h_kv]: the pairs that retrieve (the others share); ``sets`` [B, s,
    h_kv, width] the rows' anchor sets and ``chosen`` [B, h_kv] the slot each sharing pair takes its set from.
    Fixed shapes, no host read."""
    b, h_kv = here.shape
    n = c.n
    lo = c.lo_all if visible_lo is None else visible_lo.long().clamp(min=cfg.sink)
    hi = c.hi
    # The step's selection row, written by the scorer: the forced keys (sinks, and the local window where
    # visible) +inf, the retrieving pairs' candidates their probabilities (their top-k is taken), the sharing
    # pairs' candidates 0 (none taken: their count is 0) with their set's visible keys raised to +inf
    # (``kernels.anchor_share.mark_shared``).
    final = dispatch.paged_group_probs(q, kv, wt, here, (lo, hi), keep=cfg.sink).view(b * h_kv, wt)
    dispatch.anchor_mark_shared(final, sets, chosen, n, lo, cfg.sink)
    out = dispatch.select_list(final, torch.where(here.flatten(), c.pair_k, 0), c.k_w, out_width)
    # The anchors' sets: the top-m from the step's list (its candidates are the top-k), their +-r
    # neighbours in [0, n) as N, then the k - |N| best others, all from the list's own entries
    # (``kernels.anchor_sets``: one launch on GPUs).
    new_set = dispatch.anchor_sets(out, final, lo, hi, here, c.pair_m, c.pair_k, c.pair_n, c.m_w, c.k_w, cfg.radius,
                                   width)
    return new_set.view(b, h_kv, width), out.view(b, h_kv, -1)
