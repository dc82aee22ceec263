"""Attention fidelity metrics measured inside a method's own run, through the ``SparseMethod.tracer`` hook.

For a sample of query rows of every sparse attention call the tracer recomputes exact dense attention from
the same q, k, v the method saw and compares:

- ``attn_mass``: the dense attention mass (softmax over the causal keys, averaged over the g query heads
  of a KV group, since the group shares one selection) that falls on the method's selected keys; 1 means
  nothing of weight was dropped.
- ``retained``: that mass divided by the mass of the oracle top-k with the same number of units, at the
  selection's own granularity: B-token blocks for a ``BlockSelection`` (the oracle ranks blocks by their
  summed mass in that row) and tokens (or blocks, when its ``block_size`` > 1) for a ``TokenSelection``.
  The oracle is the best possible selection of that size, so ``retained`` is in [0, 1] and is exactly 1
  for the oracle's own selection; an empty selection retains 0. Only causal units count toward the size.
- ``out_err``: ||O_method - O_dense|| / ||O_dense||, Frobenius norms over the sampled rows and all query
  heads, summed over the whole run per layer before dividing (a ratio of sums, stable when a row's output
  is tiny). It is the local error of one attention call given the same inputs; errors that compound across
  layers show up in perplexity and accuracy instead.

Per (phase, layer) the tracer keeps sums, so the summary is a mean over all sampled (row, KV head) pairs.
Dense layers call no tracer and report ``None``. Rows a method marks as computed densely (a selection's
``dense_rows``, as Delta's) count as full selections; a call with no selection gives ``out_err`` only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from raysparse.methods.delta_config import DeltaSelection
from raysparse.methods.selection import SENTINEL, BlockSelection, TokenSelection, mask_from_indices

DEFAULT_ROWS = 64  # query rows sampled per prefill call: enough for a stable mean, cheap next to the prefill


def group_probs(q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Dense causal attention probabilities of query rows q [r, h, d] at absolute positions ``pos`` [r]
    over keys k [h_kv, n, d], averaged over each KV group's query heads: [h_kv, r, n] (fp32, rows sum to 1)."""
    r, h, d = q.shape
    h_kv, n, _ = k.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    s = torch.einsum("rkgd,knd->kgrn", q.float().view(r, h_kv, h // h_kv, d), k.float()) * scale
    causal = torch.arange(n, device=q.device)[None, :] <= pos[:, None]  # [r, n]
    return s.masked_fill(~causal, float("-inf")).softmax(-1).mean(1)


def dense_rows_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                      scale: float | None = None) -> torch.Tensor:
    """Exact causal attention output of rows q [r, h, d] at positions ``pos``: [r, h, d] in fp32."""
    r, h, d = q.shape
    h_kv, n, _ = k.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    s = torch.einsum("rkgd,knd->kgrn", q.float().view(r, h_kv, h // h_kv, d), k.float()) * scale
    causal = torch.arange(n, device=q.device)[None, :] <= pos[:, None]
    p = s.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("kgrn,knd->rkgd", p, v.float()).reshape(r, h, d)


def pool(probs: torch.Tensor, unit: int) -> torch.Tensor:
    """Sums probabilities [..., n] over consecutive ``unit``-token blocks: [..., ceil(n / unit)]."""
    if unit == 1:
        return probs
    n = probs.shape[-1]
    pad = -n % unit
    return torch.nn.functional.pad(probs, (0, pad)).view(*probs.shape[:-1], (n + pad) // unit, unit).sum(-1)


def retained_mass(mass: torch.Tensor, selected: torch.Tensor,
                  causal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mass [..., u]: dense mass per unit; selected, causal: bool [..., u]. Returns (retained, attn_mass) [...].

    attn_mass = mass on the selected causal units; retained = attn_mass / (mass of the top-c units by mass),
    with c the number of selected causal units.
    """
    sel = selected & causal
    got = (mass * sel).sum(-1)
    c = sel.sum(-1)
    top = mass.masked_fill(~causal, 0.0).sort(-1, descending=True).values.cumsum(-1)
    best = top.gather(-1, (c - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
    retained = torch.where(c > 0, got / best.clamp(min=torch.finfo(best.dtype).tiny), torch.zeros_like(got))
    return retained, got


def sample_rows(q_start: int, n: int, rows: int, min_pos: int) -> torch.Tensor:
    """Up to ``rows`` evenly spaced absolute query positions in [max(q_start, min_pos), n), always the last.

    Rows before ``min_pos`` (the first block) see so few keys that any selection keeps them all; sampling
    them would flatter every method.
    """
    lo = max(q_start, min(min_pos, n - 1))
    count = min(rows, n - lo)
    return torch.linspace(n - 1, lo, count).round().long().flip(0).unique()


@dataclass
class _Sums:
    retained: float = 0.0
    mass: float = 0.0
    pairs: int = 0  # (row, KV head) pairs behind retained and mass
    err_sq: float = 0.0
    ref_sq: float = 0.0


@dataclass
class FidelityTracer:
    """The ``tracer`` a harness sets on a ``SparseMethod``; accumulates per (phase, layer) sums."""

    num_layers: int
    rows: int = DEFAULT_ROWS
    sums: dict[tuple[str, int], _Sums] = field(default_factory=dict)

    def __call__(self, ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 selection: BlockSelection | TokenSelection | None, out: torch.Tensor,
                 phase: str | None = None) -> None:
        """``selection`` None (a method that cannot name its keys) measures the output error only. A
        selection with a ``dense_rows`` bool [n_q] attribute (Delta's) marks rows computed over every causal
        key: those count as a full selection. ``phase="decode"`` with q [n_q, h, d] is a multi-token decode
        step (SpecAttn's verification): every row is measured, as a decode row."""
        n = ctx.n
        with torch.no_grad():
            if q.dim() == 2:  # decode: one row, the newest position
                phase, pos, qr, outr = "decode", torch.tensor([n - 1], device=q.device), q[None], out[None]
            elif phase == "decode":  # a few new positions at once, all measured
                pos, qr, outr = torch.arange(ctx.q_start, n, device=q.device), q, out
            else:
                phase = "prefill"
                unit = selection.block_size if selection is not None else 1
                pos = sample_rows(ctx.q_start, n, self.rows, unit).to(q.device)
                qr, outr = q[pos - ctx.q_start], out[pos - ctx.q_start]
            s = self.sums.setdefault((phase, ctx.layer), _Sums())
            if selection is not None:
                # the rows of a Delta prefill computed densely attended every causal key
                dense = isinstance(selection, DeltaSelection) and phase != "decode"
                full = selection.dense_rows[pos - ctx.q_start] if dense else None
                retained, mass = selection_fidelity(selection, qr, k, pos, ctx.q_start, full)
                s.retained += float(retained.sum())
                s.mass += float(mass.sum())
                s.pairs += retained.numel()
            ref = dense_rows_output(qr, k, v, pos)
            s.err_sq += float((outr.float() - ref).pow(2).sum())
            s.ref_sq += float(ref.pow(2).sum())

    def summary(self) -> dict[str, dict[str, Any]]:
        """{"retained"|"attn_mass"|"out_err": {"overall", "prefill", "decode", "prefill_per_layer",
        "decode_per_layer"}}: means over sampled (row, KV head) pairs; None where nothing was traced."""
        def agg(items: list[_Sums], metric: str) -> float | None:
            if metric == "out_err":
                ref = sum(s.ref_sq for s in items)
                return math.sqrt(sum(s.err_sq for s in items) / ref) if ref else None
            pairs = sum(s.pairs for s in items)
            return sum(getattr(s, metric) for s in items) / pairs if pairs else None

        out: dict[str, dict[str, Any]] = {}
        for metric, attr in (("retained", "retained"), ("attn_mass", "mass"), ("out_err", "out_err")):
            entry: dict[str, Any] = {"overall": agg(list(self.sums.values()), attr)}
            for phase in ("prefill", "decode"):
                entry[phase] = agg([s for (p, _), s in self.sums.items() if p == phase], attr)
                entry[f"{phase}_per_layer"] = [agg([self.sums[(phase, i)]] if (phase, i) in self.sums else [], attr)
                                               for i in range(self.num_layers)]
            out[metric] = entry
        return out


def selection_fidelity(selection: BlockSelection | TokenSelection, q: torch.Tensor, k: torch.Tensor,
                       pos: torch.Tensor, q_start: int,
                       full_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(retained, attn_mass), each [h_kv, r], of a selection for query rows q [r, h, d] at positions ``pos``.

    A ``BlockSelection``'s row for position p is its query block p // B - q_start // B; a
    ``TokenSelection`` holds one list per KV head, shared by every row passed. Rows where ``full_rows``
    (bool [r]) is set attended every causal key.
    """
    n = k.shape[1]
    unit = selection.block_size
    units = -(-n // unit)
    mass = pool(group_probs(q, k, pos), unit)  # [h_kv, r, u]
    if isinstance(selection, BlockSelection):
        qblock = (pos // unit - q_start // unit).long()
        idx = selection.indices[:, qblock]  # [h_kv, r, S]
    else:
        idx = selection.indices[:, None, :].expand(-1, len(pos), -1)
    idx = torch.where(idx.long() >= units, torch.full_like(idx, SENTINEL), idx)  # out of range: not a key
    selected = mask_from_indices(idx, units)
    causal = (torch.arange(units, device=q.device)[None, :] * unit <= pos[:, None])[None]  # [1, r, u]
    if full_rows is not None:
        selected = selected | full_rows[None, :, None]
    return retained_mass(mass, selected, causal.expand_as(selected))
