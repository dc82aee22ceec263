"""PrHS / CPE: the methods ``cis``, ``psaw``, ``etf`` and ``cpe`` = CIS + PSAW + ETF (docs/methods/prhs.md).

The selectors live in cis.py, psaw.py and etf.py (each documents its conventions); this module composes
them into backends (their schedules and prefill, per sequence and batched; the decode and CIS's retrieval
ratio are prhs_decode.py's ``PrHSDecode``, their base) and registers all four.

- ``cis``: dense prefill; CIS decode on every non-dense layer.
- ``psaw``: exact token-level PSAW in prefill and decode at layers >= l_s; dense below.
- ``etf``: ETF in prefill (frozen rows skip attention and MLP; the rest attend densely); dense decode.
- ``cpe``: prefill = ETF + PSAW (computed rows attend over their PSAW window); decode = CIS, and at
  layers >= l_s CIS inside the PSAW window: retrieval ranks only PSAW-visible candidates and the final
  set (retrieved or shared) is intersected with the window (retrieve first, then window).

Common choices: l_s = floor(3N / 4) over 0-based layer indices (``start_layer`` overrides it); a layer in
``dense_layers`` (default 0, 1) is dense for every selector, ETF included. Density accounting is exact:
prefill counts each computed row's visible keys (frozen rows count 0 attended pairs against their causal
pairs), decode counts the selected tokens. Layers where no component acts (below l_s without CIS) are
dense layers for the base class (``is_dense_layer``: no tracer). Elsewhere the tracer sees, in prefill,
the covering BlockSelection of psaw.py (all causal blocks where rows attend densely, e.g. ``cis``; frozen
rows select nothing and their output is zero, which is what was computed for them: the effect of freezing
on the model shows in perplexity and accuracy) and, in decode, the exact TokenSelection; a decode that
runs dense (ETF) calls no tracer. ``psaw`` and ``etf`` have ``density_budget = False``: ``--density`` is
accepted and ignored (only CIS's k follows it), so the eval runs them once and reports the density their
schedule amounts to.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from raysparse.attention import causal_pairs, dense_attention
from raysparse.kernels.formats import PackedBlockSelection
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods.cis import CISConfig, CISStepConsts
from raysparse.methods.etf import ETFConfig, etf_fraction, frozen_mask, frozen_span
from raysparse.methods.prhs_decode import PrHSDecode
from raysparse.methods.psaw import (
    PrHSConfig,
    PSAWConfig,
    covering_blocks,
    depth_fraction,
    start_layer,
    visible_pairs,
    window_lo,
    window_prefill,
)
from raysparse.methods.registry import method_spec, register
from raysparse.methods.selection import BlockSelection, indices_from_mask
from raysparse.methods.views import PrefillView, SeqContext


@dataclass(frozen=True)
class CPEConfig(CISConfig, PSAWConfig, ETFConfig):
    """All of CIS, PSAW and ETF's fields (one shared ``sink`` and ``start_layer``)."""


class PrHSMethod(PrHSDecode):
    """The composition; subclasses switch components on (PrHSDecode: the decode, prhs_decode.py; PSAWWindow, its
    base: PSAW's window seams)."""

    use_cis = use_psaw = use_etf = False
    config: PrHSConfig

    # ---- schedules -----------------------------------------------------------------------------
    @property
    def start_layer(self) -> int:
        return start_layer(self.config, self.model_cfg.num_layers)  # type: ignore[arg-type]

    def is_dense_layer(self, layer: int) -> bool:
        """Configured dense layers, and layers where no component of this method acts (below l_s without
        CIS): the base class runs those as dense layers (no tracer, like ``dense_layers``)."""
        return layer in self.config.dense_layers or not (
            self.use_cis or self.psaw_frac(layer) > 0 or self.etf_frac(layer) > 0)

    def psaw_frac(self, layer: int) -> float:
        """1 - phi ** (...) at this layer; 0 where PSAW does not prune."""
        if not self.use_psaw or layer in self.config.dense_layers:
            return 0.0
        c = self.config
        return depth_fraction(c.phi, c.alpha, layer, self.start_layer, self.model_cfg.num_layers)  # type: ignore

    def etf_frac(self, layer: int) -> float:
        if not self.use_etf or layer in self.config.dense_layers:
            return 0.0
        return etf_fraction(self.config, layer, self.start_layer, self.model_cfg.num_layers)  # type: ignore

    def plan_layers(self, cache: KVCache, batch: BatchMeta) -> dict[int, torch.Tensor | None] | CISStepConsts | None:
        """A prefill step's ETF masks, {layer: ``frozen_mask``} at every layer ETF freezes at (asked by the model
        and by the batched selection: built once, before the layers); a decode step's, CIS's (``PrHSDecode``)."""
        if not batch.is_prefill:
            return super().plan_layers(cache, batch)
        if not self.use_etf:
            return None
        fracs = {layer: self.etf_frac(layer) for layer in range(self.model_cfg.num_layers)}
        return {layer: frozen_mask(frac, self.config.sink, batch) for layer, frac in fracs.items() if frac > 0}

    def frozen_rows(self, layer: int, batch: BatchMeta) -> torch.Tensor | None:
        """The model's ETF hook: bool [T] of the rows frozen at this layer, or None: the step's plan's mask (a
        layer driven on its own, with no plan, builds it)."""
        frac = self.etf_frac(layer)
        if not batch.is_prefill or frac <= 0:
            return None
        done, plan = self.planned(batch)
        return plan[layer] if done else frozen_mask(frac, self.config.sink, batch)

    # ---- prefill -------------------------------------------------------------------------------
    def prefill(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        if self._cis is not None and layer == 0:
            for sid in batch.seq_ids:  # the batched CIS state starts empty at a sequence's first decode step
                self._cis.forget(sid)
        if self.use_etf and self.config.etf_kv == "copy":  # type: ignore[attr-defined]
            frozen = self.frozen_rows(layer, batch)
            if frozen is not None:  # etf_kv="copy": frozen tokens keep the previous layer's K/V
                rows = frozen.nonzero().squeeze(1)
                pg, off = batch.slot_pages[rows], batch.slot_offsets[rows]
                cache.k[layer][pg, :, off] = cache.k[layer - 1][pg, :, off]
                cache.v[layer][pg, :, off] = cache.v[layer - 1][pg, :, off]
        return super().prefill(layer, q, cache, batch)

    def _live_rows(self, ctx: SeqContext) -> list[tuple[int, int]]:
        """Computed (not frozen) rows of this call, as ranges of row offsets."""
        n_q = ctx.n - ctx.q_start
        a, b = frozen_span(self.etf_frac(ctx.layer), self.config.sink, ctx.n, ctx.q_start)
        if a >= b:
            return [(0, n_q)]
        return [(x, y) for x, y in ((0, a - ctx.q_start), (b - ctx.q_start, n_q)) if x < y]

    def select_prefill(self, ctx, q, k, v) -> BlockSelection:
        live = torch.zeros(ctx.n - ctx.q_start, dtype=torch.bool, device=q.device)
        for a, b in self._live_rows(ctx):
            live[a:b] = True
        return covering_blocks(ctx.q_start, ctx.n, self.config.block_size, self.config.sink,
                               self.psaw_frac(ctx.layer), live, k.shape[0])

    # ---- the batched prefill seam: PSAW's windows and ETF's frozen rows ------------------------------
    @property
    def batched_prefill(self) -> bool:  # type: ignore[override]
        return self.use_psaw or self.use_etf

    def prefill_selects(self, layer: int, batch: BatchMeta) -> bool:
        # Below l_s, and at ETF's layers in a step that freezes no row (a chunk past E_l(t)), the prefill is
        # dense: the per-sequence path's SDPA, cheaper there than the block kernel over every causal block.
        return self.psaw_frac(layer) > 0 or self.frozen_rows(layer, batch) is not None

    def prefill_select(self, layer: int, q: torch.Tensor, view: PrefillView) -> PackedBlockSelection:
        """Every query block's covering key blocks (``covering_blocks``: from the window bound of its first
        row, the lowest) and each row's own bound, which the kernel applies inside the blocks: the exact
        token-level window of ``window_prefill`` in one varlen launch over the pages. A query block whose
        rows ETF freezes all attends its sink block alone (the model carries those rows' hidden states and
        drops their output, ``frozen_rows``), so frozen blocks cost next to nothing."""
        b, sink, frac = self.config.block_size, self.config.sink, self.psaw_frac(layer)
        rows = view.qblocks(b)
        lo_first = window_lo(frac, torch.maximum(rows.qblock * b, rows.q_start))
        kb = torch.arange(-(-max(view.batch.ctx_lens) // b), device=lo_first.device)[None, :]
        mask = (kb <= rows.qblock[:, None]) & ((kb * b < sink) | (kb * b + b - 1 >= lo_first[:, None]))
        frozen = self._frozen_blocks(layer, view, rows.qblock.shape[0])
        if frozen is not None:
            mask &= ~frozen[:, None] | (kb == 0)
        sel = view.packed(indices_from_mask(mask)[None].expand(view.cache.num_kv_heads, -1, -1), b)
        lo = window_lo(frac, view.batch.positions.to(lo_first.device))
        return replace(sel, window_lo=lo.to(torch.int32), sink=sink)

    def _frozen_blocks(self, layer: int, view: PrefillView, num_blocks: int) -> torch.Tensor | None:
        """bool [R]: the packed query blocks whose rows all lie in their sequence's frozen span at this layer
        (None: no row is frozen)."""
        if self.frozen_rows(layer, view.batch) is None:
            return None
        b, batch, frac = self.config.block_size, view.batch, self.etf_frac(layer)
        rows = view.qblocks(b)
        spans = torch.tensor([frozen_span(frac, self.config.sink, n, n - m)
                              for n, m in zip(batch.ctx_lens, batch.q_lens, strict=True)], device=rows.seq.device)
        a, z = spans[rows.seq.long()].unbind(-1)  # each block's sequence's frozen rows [a, z)
        first = torch.maximum(rows.qblock * b, rows.q_start)
        return (first >= a) & (torch.minimum(rows.qblock * b + b, rows.n) <= z)

    def prefill_pairs(self, view: PrefillView, sel: PackedBlockSelection) -> torch.Tensor:
        """Token-exact, as ``window_prefill`` counts: sinks plus each row's window."""
        pos = view.batch.positions.to(sel.window_lo.device)
        per_row = visible_pairs(pos, sel.window_lo.long(), sel.sink)
        frozen = self.frozen_rows(view.layer, view.batch)
        if frozen is not None:  # a frozen row attends nothing that counts: the model drops its output
            per_row = per_row.masked_fill(frozen.to(per_row.device), 0)
        seq = torch.repeat_interleave(torch.arange(len(view.batch.q_lens), device=pos.device),
                                      torch.tensor(view.batch.q_lens, device=pos.device))
        per_seq = torch.zeros(len(view.batch.q_lens), dtype=torch.int64, device=pos.device)
        return per_seq.index_add_(0, seq, per_row) * view.cache.num_kv_heads

    def prefill_seq(self, ctx, q, k, v) -> tuple[torch.Tensor, float]:
        rows, frac = self._live_rows(ctx), self.psaw_frac(ctx.layer)
        if frac == 0.0 and rows == [(0, q.shape[0])]:  # dense here (CIS, or a wrapper such as Delta)
            out, pairs = dense_attention(q, k, v), float(causal_pairs(q.shape[0], ctx.n) * k.shape[0])
        else:
            out, pairs = window_prefill(q, k, v, ctx.q_start, self.config.sink, frac, rows)
        if self.tracer is not None:
            self.tracer(ctx, q, k, v, self.select_prefill(ctx, q, k, v), out)
        return out, pairs


class CIS(PrHSMethod):
    name = "cis"
    config_cls = CISConfig
    use_cis = True


class PSAW(PrHSMethod):
    name = "psaw"
    config_cls = PSAWConfig
    use_psaw = True
    density_budget = False  # the depth schedule (phi, alpha, l_s) is the budget: --density does not apply


class ETF(PrHSMethod):
    name = "etf"
    config_cls = ETFConfig
    use_etf = True
    density_budget = False  # the depth schedule (psi, gamma, l_s) is the budget: --density does not apply
    # Which rows are frozen depends on the prompt's length t, so a prefix's K/V differ from one prompt to
    # another with the same tokens: never reused from the prefix cache.
    prefix_state = "none"


class CPE(PrHSMethod):
    name = "cpe"
    config_cls = CPEConfig
    use_cis = use_psaw = use_etf = True
    prefix_state = "none"  # ETF's frozen rows depend on the prompt's length (as ``ETF``)


register(method_spec(CIS, "PrHS CIS: per-head top-k retrieval shared across similar queries, dilated (decode)"))
register(method_spec(PSAW, "PrHS PSAW: sinks + depth-progressive sliding window from layer 3N/4 (prefill+decode)"))
register(method_spec(ETF, "PrHS ETF: early tokens frozen (attention and MLP skipped) from layer 3N/4 (prefill)"))
register(method_spec(CPE, "PrHS CPE: CIS + PSAW decode, PSAW + ETF prefill"))
