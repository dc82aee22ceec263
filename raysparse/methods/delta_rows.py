"""Delta's dense rows and their bookkeeping (the method is in ``delta.py``): where one sequence's anchor, check
and tail rows come from (``SeqRows`` over its own K/V for ``prefill_seq``; ``PackedRows`` computing every
sequence's rows of a batched prefill over the paged cache in two kernel launches, sliced per sequence by
``SliceRows``), the causal pairs those rows add to the base's (``extra_pairs``), the far-merge prediction from an
anchor's far part, and the fit's summary. The correction that uses them is in ``delta_correction.py``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from raysparse.attention import causal_pairs
from raysparse.kernels import dispatch
from raysparse.kernels.reference import dense_rows_attention
from raysparse.methods.selection import SENTINEL, BlockSelection, mask_from_indices
from raysparse.methods.views import PrefillView

# (q_start, n_q, n) -> (anchor rows, ascending check rows, first tail row): one chunk's local row indices, host-side
RowSets = Callable[[int, int, int], tuple[range, list[int], int]]


class RowIndex(NamedTuple):
    """One sequence's dense rows of a prefill call: the host's sets (``RowSets``) and their device copies, all
    of a call's sequences in one host-to-device copy (``row_indices``; a copy per list and sequence waited for
    the device each time)."""

    anchor_rows: range  # local rows
    check_rows: list[int]  # local rows, ascending
    tail_lo: int  # the first tail row (n_q: no tail)
    anchors: torch.Tensor  # int64 device copies of the above
    checks: torch.Tensor
    plain: torch.Tensor  # rows computed as plain dense rows: the check rows below the tail, then the tail
    dense_at: torch.Tensor  # absolute positions of every dense row (anchors, checks, tail), ascending
    dense_pairs: int  # sum(dense_at + 1): the causal pairs of those rows per KV head


def row_indices(row_sets: RowSets, spans: list[tuple[int, int, int]], device: torch.device) -> list[RowIndex]:
    """``RowIndex`` of each (q_start, n_q, n) in ``spans``, with one host-to-device copy for all of them."""
    sets, parts, sizes = [], [], []
    for q_start, n_q, n in spans:
        anchor_rows, checks, tail_lo = row_sets(q_start, n_q, n)
        plain = [c for c in checks if c < tail_lo] + list(range(tail_lo, n_q))
        at = sorted({q_start + r for r in (*anchor_rows, *checks, *range(tail_lo, n_q))})
        sets.append((anchor_rows, checks, tail_lo, sum(at) + len(at)))
        for lst in (list(anchor_rows), checks, plain, at):
            parts.extend(lst)
            sizes.append(len(lst))
    host = torch.tensor(parts, dtype=torch.long)
    flat = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    pieces = flat.split(sizes)
    return [RowIndex(a, c, t, *pieces[4 * i:4 * i + 4], pairs) for i, (a, c, t, pairs) in enumerate(sets)]


def extra_pairs(sel: BlockSelection | None, rows: torch.Tensor, h_kv: int, n: int, q_start: int,
                base_pairs: float, row_pairs: int | None = None) -> float | torch.Tensor:
    """Causal pairs of the dense rows (absolute positions ``rows``) the base did not attend: with the base's blocks
    a device scalar (no host read), else a float. ``row_pairs``: sum(rows + 1) if the host knows it."""
    dense_pairs = float((rows + 1).sum() if row_pairs is None else row_pairs) * h_kv
    if sel is None:
        return max(0.0, min(dense_pairs, causal_pairs(n - q_start, n) * h_kv - base_pairs))
    b = sel.block_size
    kb = sel.indices[:, rows // b - q_start // b].long()  # [h_kv, |D|, S]
    lo = kb * b
    hi = torch.minimum(lo + b, rows[None, :, None] + 1)
    covered = ((hi - lo).clamp(min=0) * (kb != SENTINEL)).sum()
    return dense_pairs - covered.double()


def far_merge_prediction(q: torch.Tensor, o_s: torch.Tensor, lse_s: torch.Tensor, q_a: torch.Tensor,
                         o_far: torch.Tensor, lse_far: torch.Tensor, kbar: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """The far-merge correction of rows whose own sparse attention is (o_s [r, h, d], lse_s [r, h]) from their
    anchors' far part (q_a, o_far, kbar [r, h, d], lse_far [r, h]; the anchor of each row, gathered): the row's
    far log-mass is the anchor's plus its first-order change (q - q_a) . kbar * scale (a lower bound: lse is
    convex in q), its far output the anchor's, merged with the row's own by log-sum-exp. Returns
    O_merged - o_s = w (o_far - o_s), w = the estimated far share of the row's attention."""
    lse_hat = lse_far + ((q.float() - q_a) * kbar).sum(-1) * scale
    w = torch.exp(lse_hat - torch.logaddexp(lse_hat, lse_s))
    w = torch.where(torch.isfinite(lse_hat), w, torch.zeros_like(w))  # no far key: no correction
    return w[..., None] * (o_far - o_s)


class Rows:
    """Where ``DeltaCorrection._correct`` takes one sequence's dense rows from (local row indices ``idx``, absolute
    positions ``pos``; outputs fp32): its anchors with their far part outside the base's blocks, its strided
    anchors, and plain dense rows (check rows, tail)."""

    h_kv: int
    index: RowIndex  # the sequence's dense rows of this call

    def far(self, idx: torch.Tensor, pos: torch.Tensor, sel: BlockSelection, q_start: int, n: int
            ) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def strided(self, gamma: int, q_start: int) -> torch.Tensor:
        raise NotImplementedError

    def dense(self, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class SeqRows(Rows):
    """One sequence's rows over its contiguous K/V (``prefill_seq``)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: RowIndex) -> None:
        self.q, self.k, self.v, self.h_kv, self.index = q, k, v, k.shape[0], index

    def far(self, idx, pos, sel, q_start, n):
        blocks = row_blocks(sel, pos, q_start, n)
        o_rows, _, o_far, lse_far, kbar = dense_rows_attention(self.q[idx], pos, self.k, self.v, blocks, sel.block_size)
        return o_rows, o_far, lse_far, kbar

    def strided(self, gamma, q_start):
        return dispatch.strided_dense_attention(self.q, self.k, self.v, gamma, q_start)[0].float()

    def dense(self, idx, pos):
        return dense_rows_attention(self.q[idx], pos, self.k, self.v)[0]


class PackedRows:
    """Every sequence's dense rows of a batched prefill, computed up front over the paged cache in place: the
    anchors with their far part in one ``dense_rows`` launch (far-merge; the strided kernel otherwise), the
    check and tail rows in another. ``of(i)`` hands sequence i's slices to ``_correct``."""

    def __init__(self, row_sets: RowSets, mode: str, gamma: int, q: torch.Tensor, view: PrefillView,
                 sel: Any) -> None:
        batch, dev = view.batch, q.device
        b = sel.block_size
        self.h_kv = view.kv.k.shape[1]
        self.index = row_indices(row_sets, [(n - n_q, n_q, n) for n_q, n in zip(batch.q_lens, batch.ctx_lens,
                                                                                 strict=True)], dev)
        self.anchors, self.dense_idx = [], []
        a_tok, a_pos, a_qb, d_tok, d_pos = [], [], [], [], []
        qb0 = 0
        for i, (n_q, n) in enumerate(zip(batch.q_lens, batch.ctx_lens, strict=True)):
            q_start, lo = n - n_q, batch.cu_q[i]
            anchors, rest = self.index[i].anchors, self.index[i].plain  # plain rows ascend
            self.anchors.append(anchors)
            self.dense_idx.append(rest)
            a_tok.append(lo + anchors)
            a_pos.append(q_start + anchors)
            a_qb.append(qb0 + (q_start + anchors) // b - q_start // b)
            d_tok.append(lo + rest)
            d_pos.append(q_start + rest)
            qb0 += (n - 1) // b - q_start // b + 1
        self.a_cu = _cumsum([len(a) for a in self.anchors])
        self.d_cu = _cumsum([len(r) for r in self.dense_idx])
        self.far_rows: tuple[torch.Tensor, ...] = ()
        self.strided_rows: torch.Tensor | None = None
        if mode == "far-merge":
            nb = -(-max(batch.ctx_lens) // b)
            near = mask_from_indices(sel.indices[:, torch.cat(a_qb)], nb)
            o, _, o_far, lse_far, kbar = dispatch.dense_rows_attention_varlen(
                q, view.kv, torch.cat(a_tok), torch.cat(a_pos), [len(a) for a in self.anchors], near, b)
            self.far_rows = (o, o_far, lse_far, kbar)
        elif mode != "sparse-only":
            self.strided_rows = dispatch.strided_dense_attention_varlen(
                q, view.kv, view.cu_q_dev, gamma, list(batch.q_lens), list(batch.ctx_lens))[0].float()
        self.dense_out = dispatch.dense_rows_attention_varlen(q, view.kv, torch.cat(d_tok), torch.cat(d_pos),
                                                              [len(r) for r in self.dense_idx])[0]

    def of(self, i: int) -> Rows:
        return SliceRows(self, i)


class SliceRows(Rows):
    """Sequence i's slices of a ``PackedRows``; asks for rows it computed (checked)."""

    def __init__(self, packed: PackedRows, i: int) -> None:
        self.p, self.i, self.h_kv, self.index = packed, i, packed.h_kv, packed.index[i]

    def far(self, idx, pos, sel, q_start, n):
        lo, hi = self.p.a_cu[self.i], self.p.a_cu[self.i + 1]
        assert idx.shape[0] == hi - lo, "Delta asked for other anchors than it computed"
        return tuple(t[lo:hi] for t in self.p.far_rows)

    def strided(self, gamma, q_start):
        assert self.p.strided_rows is not None
        return self.p.strided_rows[self.p.a_cu[self.i]:self.p.a_cu[self.i + 1]]

    def dense(self, idx, pos):
        lo, hi = self.p.d_cu[self.i], self.p.d_cu[self.i + 1]
        return self.p.dense_out[lo:hi][torch.searchsorted(self.p.dense_idx[self.i], idx)]


def _cumsum(xs: list[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def fit_summary(alpha_sum: list[float], heads: list[float], fell: list[float], before: list[float],
                after: list[float]) -> dict[str, Any]:
    """Delta's fitted correction from its sums (``DeltaCorrection.fit_sums``), overall and per layer, over the
    prefill calls summed: the mean fitted alpha of the query heads (each call's final fit), the fraction of heads
    that fell back (alpha < 0.05), and the check rows' error ratio ||D - alpha D_pred|| / ||D||, each check row
    predicted with the alpha fitted on the check rows before it (an out-of-sample test of the correction; below 1:
    it helps). None where nothing was fitted (dense layers; modes without a fit)."""
    def ratio(a: float, b: float) -> float | None:
        return math.sqrt(a / b) if b > 0 else None

    h = sum(heads)
    return {"alpha": sum(alpha_sum) / h if h else None, "fallback": sum(fell) / h if h else None,
            "check_error_ratio": ratio(sum(after), sum(before)),
            "alpha_per_layer": [a / n if n else None for a, n in zip(alpha_sum, heads, strict=True)],
            "fallback_per_layer": [f / n if n else None for f, n in zip(fell, heads, strict=True)],
            "check_error_ratio_per_layer": [ratio(a, b) for a, b in zip(after, before, strict=True)]}


def row_blocks(sel: BlockSelection, rows: torch.Tensor, q_start: int, n: int) -> torch.Tensor:
    """The key blocks the base attends for each row at absolute position ``rows``: [h_kv, m, ceil(n / B)]."""
    b = sel.block_size
    return mask_from_indices(sel.indices[:, rows // b - q_start // b], -(-n // b))
