"""Delta's correction of one sequence's prefill (``DeltaCorrection``, the base of delta.py's ``Delta``, which holds
the method: its base, the density budget, decode and the prefill paths): from the base's output (with its lse and
BlockSelection) and the dense rows (delta_rows.py's ``Rows``), each row's predicted correction from its anchor,
scaled per query head by the fitted alpha, and the fit's statistics. The modes:

- ``far-merge`` (the default): the anchor's attention over its causal keys OUTSIDE the base's selection (its
  "far" part: output O_far(a), log-mass lse_far(a) and mean key kbar(a) under those weights) is merged into each
  row's own sparse attention (O_sparse(i), lse_sparse(i), from the base's kernel) by log-sum-exp, with the row's
  far log-mass estimated to first order, lse_far(a) + (q_i - q_a) . kbar(a) / sqrt(d) (a lower bound: lse is
  convex in q). So the correction is D_pred(i) = w(i) (O_far(a) - O_sparse(i)), w(i) = the estimated far share
  of row i's attention. A block-level base attends the same key blocks for every row of a query block, so with
  gamma = block_size the anchor's far keys are exactly its rows' far keys; only the queries differ. A base that
  reports no BlockSelection has no far part: this mode then uses the paper's difference (``delta-shrunk``).
- ``delta-shrunk``: the paper's D_pred(i) = O_dense(a) - O_sparse(a), scaled by the fitted alpha.
- ``delta``: the published formula as written, O[i] = O_sparse[i] + (O_dense(a) - O_sparse(a)).
- ``recompute`` only swaps in the dense rows; ``sparse-only`` returns O_sparse.

The fitted modes apply O = O_sparse + alpha D_pred, with alpha per query head fitted on check rows: the rows
gamma j + gamma // 2 of the first ``check_every`` gamma-blocks j and then of one block in ``check_every``,
computed densely (so they are exact too). At a check row c the true correction D(c) = O_dense(c) - O_sparse(c)
is known; alpha(i) = clamp(sum <D(c), D_pred(c)> / sum ||D_pred(c)||^2, 0, 1) over the check rows c <= i (the
earlier chunks' carried in Delta's per-sequence state), 0 before the first informative one. alpha fitted over all
check rows never raises their error above the base's (least squares on [0, 1], which holds 0); alpha -> 0 falls back to
the base plus the exact dense rows, i.e. ``recompute``. ``alpha=x`` fixes it (0: ``recompute``). The stats
(``stats_dict``; ``raysparse eval``'s ``fallback`` column and ``extras.delta``) give per layer the mean fitted
alpha, the fraction of heads that fell back (alpha < 0.05) and the check rows' error ratio ||D - alpha D_pred|| /
||D||, each check row predicted with the alpha fitted before it (out of sample: below 1, the correction helps).

Choices the published method leaves open:
- Density accounting counts the union: attended = base pairs + sum over the dense rows of (causal keys of the
  row - keys the base already attended in that row), read from the base's BlockSelection. A base that reports
  none falls back to min(base pairs + dense pairs, causal pairs), an upper bound.
- Anchors stay the published R (the first row of each gamma-block): a row's anchor is then never after it, so a chunked
  prefill gives the whole prompt's output (rows before a chunk's first anchor use the previous chunk's anchor,
  carried in Delta's per-sequence state, as does the fit). The tail is the last rows of each chunk.

Why far-merge is the default: on the default model a row's true correction is far from its anchor's, so the
published difference raises every layer's output error, and of the predictors measured far-merge's error is the
lowest that costs no more than the anchors (docs/methods/delta.md).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from raysparse.config import ModelConfig
from raysparse.kernels import dispatch
from raysparse.methods.base import SparseMethod
from raysparse.methods.delta_config import FITTED, DeltaConfig
from raysparse.methods.delta_rows import Rows, extra_pairs, far_merge_prediction, fit_summary
from raysparse.methods.selection import BlockSelection
from raysparse.methods.views import SeqContext

FALLBACK_ALPHA = 0.05  # a head whose fitted alpha is below this counts as fallen back (stats)
NOISE = 1e-5  # a predicted correction below this fraction of a check row's output is no evidence for alpha
NOISE_ROUNDINGS = 8  # ... nor one below this many unit roundoffs of the attends that computed it


class DeltaCorrection(SparseMethod):
    """One sequence's corrected prefill from its base's output and its dense rows (``_correct``, shared by
    ``Delta``'s per-sequence and batched prefill), the fitted alpha and its statistics per layer."""

    config: DeltaConfig

    def __init__(self, model_cfg: ModelConfig, config: DeltaConfig | None = None) -> None:
        super().__init__(model_cfg, config)
        self.reset_stats()

    # ---- statistics: the fitted correction per layer ----------------------------------------------
    def reset_stats(self) -> None:
        self._heads = [0] * self.model_cfg.num_layers
        # per layer: the fitted alphas' sum, the heads fallen back, the check rows' error before and after; on the
        # device the fit runs on (a host read per fitted layer would stall every prefill step), read by fit_sums
        self._fit: torch.Tensor | None = None

    def fit_sums(self) -> tuple[list[float], ...]:
        """The additive sums behind ``stats_dict`` (per layer; summed over requests, items and TP shards)."""
        n = self.model_cfg.num_layers
        fit = self._fit.T.tolist() if self._fit is not None else [[0.0] * n] * 4
        return fit[0], [float(h) for h in self._heads], fit[1], fit[2], fit[3]

    def item_sums(self) -> dict[str, Any]:
        return {"delta": self.fit_sums()}

    def stats_dict(self) -> dict[str, Any]:
        return {"mode": self.config.mode, **fit_summary(*self.fit_sums())}

    def _row_sets(self, q_start: int, n_q: int, n: int) -> tuple[range, list[int], int]:
        """One call's dense rows, local to its n_q rows, on the host (they follow from the lengths alone, so
        nothing is read back from the device): the anchors (absolute positions 0 mod gamma; a short chunk may
        hold none), the check rows ascending (none unless the correction is fitted on them) and the first tail
        row (n_q: no tail)."""
        cfg, gamma = self.config, self.config.gamma
        first = (-q_start) % gamma
        anchors = range(min(first, n_q), n_q, gamma)
        checks: list[int] = []
        if cfg.mode in FITTED and cfg.alpha is None and cfg.checks:
            off, every = cfg.check_offset, cfg.check_every
            # positions off mod gamma of the first `every` gamma-blocks, then of one block in `every`: the blocks
            # whose such position lies in [q_start, q_start + n_q), as one array op (no loop over the blocks)
            blk = np.arange(max(0, -(-(q_start - off) // gamma)), -(-(q_start + n_q - off) // gamma))
            blk = blk[(blk < every) | (blk % every == every - 1)]
            checks = (blk * gamma + off - q_start).tolist()
        tail_lo = max(n - cfg.tail_rows(n), q_start) - q_start
        return anchors, checks, min(tail_lo, n_q)

    def _correct(self, ctx: SeqContext, q: torch.Tensor, rows: Rows, o_sparse: torch.Tensor,
                 lse_s: torch.Tensor | None, attended: float, base_sel: BlockSelection | None
                 ) -> tuple[torch.Tensor, torch.Tensor, float | torch.Tensor]:
        """One sequence's corrected output from the base's (``o_sparse``, its lse and selection; ``attended``:
        the base's pairs), its dense rows taken from ``rows``: the output, which rows were computed densely, and
        the causal pairs those rows add (a device scalar where the base's blocks decide them)."""
        cfg, gamma = self.config, self.config.gamma
        far = cfg.mode == "far-merge" and lse_s is not None and base_sel is not None  # else: the paper's difference
        n_q, n = q.shape[0], ctx.n
        pos = ctx.q_start + torch.arange(n_q, device=q.device)
        dense = torch.zeros(n_q, dtype=torch.bool, device=q.device)
        if cfg.mode == "sparse-only":
            return o_sparse, dense, 0.0
        first = (-ctx.q_start) % gamma
        index = rows.index
        anchors, tail_lo = index.anchors, index.tail_lo
        out = o_sparse.float()
        if far:
            o_rows, o_far, lse_far, kbar = rows.far(anchors, pos[anchors], base_sel, ctx.q_start, n)
            per_row = self._per_row(ctx, "far_carry", (q[anchors].float(), o_far, lse_far, kbar),
                                    (0.0, 0.0, -math.inf, 0.0), pos, first)
            pred = far_merge_prediction(q, out, lse_s, *per_row, 1.0 / math.sqrt(q.shape[-1]))
        else:
            o_rows = rows.strided(gamma, ctx.q_start)
            pred = None
            if cfg.mode != "recompute":
                pred = self._per_row(ctx, "delta_carry", (o_rows - out[anchors],), (0.0,), pos, first)[0]
        checks = None
        if pred is not None:
            alpha, checks = self._alpha(ctx, q, pos, out, pred, rows, index.checks)
            out = out + (pred if alpha is None else alpha[..., None] * pred)
        out[anchors] = o_rows
        dense[anchors] = True
        # check rows exist only where the correction is fitted on them, so they are always computed densely:
        # ``index.dense_at`` (every dense row, from the host) is the rows set here
        assert checks is not None or not index.check_rows
        if checks is not None:
            out[checks[0]] = checks[1]
            dense[checks[0]] = True
        if tail_lo < n_q:
            tail = torch.arange(tail_lo, n_q, device=q.device)
            out[tail_lo:] = rows.dense(tail, pos[tail])
            dense[tail_lo:] = True
        extra = extra_pairs(base_sel, index.dense_at, rows.h_kv, n, ctx.q_start, attended, index.dense_pairs)
        return out.to(q.dtype), dense, extra

    def _per_row(self, ctx: SeqContext, key: str, rows: tuple[torch.Tensor, ...], fills: tuple[float, ...],
                 pos: torch.Tensor, first: int) -> tuple[torch.Tensor, ...]:
        """Each row's anchor's entry of ``rows`` (per anchor of the call, [m, ...] each): [n_q, ...] each. Rows
        before the call's first anchor take the previous anchor's, carried in ``_carries(ctx)[key]`` from the chunk
        that computed it (``fills`` where there is none)."""
        gamma, st = self.config.gamma, _carries(ctx)
        anchor0 = (ctx.q_start // gamma) * gamma  # anchor of the call's first row
        carry = st.get(key)
        use_carry = carry is not None and carry[0] == anchor0 and first
        tables = []
        for i, (r, fill) in enumerate(zip(rows, fills, strict=True)):
            prev = carry[1][i].to(r)[None] if use_carry else r.new_full((1, *r.shape[1:]), fill)
            tables.append(torch.cat([prev, r]))
        m = rows[0].shape[0]
        if m:
            st[key] = (ctx.q_start + first + gamma * (m - 1), tuple(r[-1] for r in rows))
        group = torch.div(pos - (ctx.q_start + first), gamma, rounding_mode="floor") + 1  # 0: before first anchor
        return tuple(t[group] for t in tables)

    def _alpha(self, ctx: SeqContext, q: torch.Tensor, pos: torch.Tensor, o_s: torch.Tensor, pred: torch.Tensor,
               rows: Rows, ci: torch.Tensor
               ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """The correction's scale per row and query head ([n_q, h]; None: 1, the paper's), and the check rows
        (local indices, dense outputs) where they are computed. Fitted: alpha(i) = clamp(<D, D_pred> / ||D_pred||^2,
        0, 1) per head over the check rows at or before row i (this chunk's and, carried in ``_carries(ctx)``, the
        earlier chunks'), D = the check row's true correction O_dense - O_sparse and D_pred its predicted one;
        no check row yet, or no predicted correction there: 0, the base."""
        cfg = self.config
        if cfg.mode == "delta" or (cfg.alpha is None and not cfg.checks):
            return None, None
        if cfg.alpha is not None:
            return torch.full(pred.shape[:2], cfg.alpha, device=pred.device), None
        o_chk = rows.dense(ci, pos[ci])  # ci: the check rows (``_row_sets``)
        d_true, d_pred = o_chk - o_s[ci], pred[ci]
        h = q.shape[1]
        st = _carries(ctx)
        carry = st.get("delta_fit")
        if carry is not None and carry[0] == ctx.q_start:
            num0, den0 = carry[1].to(pred), carry[2].to(pred)
        else:
            num0 = den0 = pred.new_zeros(h)
        # A check row whose predicted correction is rounding noise says nothing of alpha: below 1e-5 of the row's
        # output (the base already attends every causal key there), or below NOISE_ROUNDINGS roundoffs of the
        # attends that made it (TF32 kernels on GPUs, 16-bit outputs), where the fit would follow the noise.
        noise = max(NOISE, NOISE_ROUNDINGS * dispatch.attend_rounding(q))
        sq = (d_pred * d_pred).sum(-1)
        some = sq > noise ** 2 * (o_s[ci] * o_s[ci]).sum(-1)
        num = torch.cat([num0[None], num0 + torch.where(some, (d_true * d_pred).sum(-1), 0.0).cumsum(0)])
        den = torch.cat([den0[None], den0 + torch.where(some, sq, 0.0).cumsum(0)])  # [checks + 1, h]
        st["delta_fit"] = (ctx.n, num[-1], den[-1])
        fitted = torch.where(den > 0, (num / den.clamp(min=1e-30)).clamp(0.0, 1.0), torch.zeros_like(num))
        alpha = fitted[torch.searchsorted(pos[ci], pos, right=True)]  # the fit over the check rows <= row
        # Statistics: each check row predicted by the alpha of the check rows before it, and the final alpha.
        layer = ctx.layer
        if self._fit is None:
            self._fit = torch.zeros(self.model_cfg.num_layers, 4, dtype=torch.float64, device=pred.device)
        self._fit[layer] += torch.stack([fitted[-1].sum(), (fitted[-1] < FALLBACK_ALPHA).sum(), (d_true * d_true).sum(),
                                         ((d_true - fitted[:-1, :, None] * d_pred) ** 2).sum()]).double()
        self._heads[layer] += h
        return alpha, (ci, o_chk)


def _carries(ctx: SeqContext) -> dict[str, Any]:
    """What Delta carries from one prefill chunk to the next at ``ctx``'s layer (the last anchor's rows, the
    fit's sums). Kept in Delta's own per-sequence state, not in the layer's metadata slot (``ctx.state``),
    which belongs to the base: a base may replace it whole at each step."""
    return ctx.seq_state.setdefault(("delta", ctx.layer), {})

