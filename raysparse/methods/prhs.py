"""PrHS / CPE (SPEC section 5): the methods ``cis``, ``psaw``, ``etf`` and ``cpe`` = CIS + PSAW + ETF.

The selectors live in cis.py, psaw.py and etf.py (each documents its conventions); this module composes
them into backends and registers all four.

- ``cis``: dense prefill; CIS decode on every non-dense layer.
- ``psaw``: exact token-level PSAW in prefill and decode at layers >= l_s; dense below.
- ``etf``: ETF in prefill (frozen rows skip attention and MLP; the rest attend densely); dense decode.
- ``cpe``: prefill = ETF + PSAW (computed rows attend over their PSAW window); decode = CIS, and at
  layers >= l_s CIS inside the PSAW window: retrieval ranks only PSAW-visible candidates and the final
  set (retrieved or shared) is intersected with the window, as in the paper's Fig. 6 ordering.

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
schedule amounts to. The retrieval ratio rho is ``retrieval_ratio``
(overall) and ``retrieval_ratio_per_layer()`` on ``cis`` and ``cpe`` backends (``None`` before any step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raysparse.attention import causal_pairs, dense_attention
from raysparse.config import ModelConfig
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods.base import DecodeView, SeqContext, SparseMethod, method_spec
from raysparse.methods.cis import CISConfig, cis_step
from raysparse.methods.etf import ETFConfig, etf_fraction, frozen_mask, frozen_span
from raysparse.methods.psaw import (
    PrHSConfig,
    PSAWConfig,
    covering_blocks,
    depth_fraction,
    start_layer,
    window_lo,
    window_prefill,
    window_start,
)
from raysparse.methods.registry import register
from raysparse.methods.selection import SENTINEL, BlockSelection, TokenSelection, indices_from_mask


@dataclass(frozen=True)
class CPEConfig(CISConfig, PSAWConfig, ETFConfig):
    """All of CIS, PSAW and ETF's fields (one shared ``sink`` and ``start_layer``)."""


class PrHSMethod(SparseMethod):
    """The composition; subclasses switch components on."""

    use_cis = use_psaw = use_etf = False
    config: PrHSConfig

    def __init__(self, model_cfg: ModelConfig, config: PrHSConfig | None = None) -> None:
        super().__init__(model_cfg, config)
        layers = model_cfg.num_layers
        self._retrievals: list[torch.Tensor | int] = [0] * layers
        self._head_steps = [0] * layers

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

    def frozen_rows(self, layer: int, batch: BatchMeta) -> torch.Tensor | None:
        """The model's ETF hook: bool [T] of the rows frozen at this layer, or None."""
        frac = self.etf_frac(layer)
        return frozen_mask(frac, self.config.sink, batch) if batch.is_prefill and frac > 0 else None

    # ---- prefill -------------------------------------------------------------------------------
    def prefill(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        if self.use_etf and self.config.etf_kv == "copy":  # type: ignore[attr-defined]
            frozen = self.frozen_rows(layer, batch)
            if frozen is not None:  # Appendix G: frozen tokens keep the previous layer's K/V
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

    def prefill_seq(self, ctx, q, k, v) -> tuple[torch.Tensor, float]:
        rows, frac = self._live_rows(ctx), self.psaw_frac(ctx.layer)
        if frac == 0.0 and rows == [(0, q.shape[0])]:  # dense here (CIS, or a wrapper such as Delta)
            out, pairs = dense_attention(q, k, v), float(causal_pairs(q.shape[0], ctx.n) * k.shape[0])
        else:
            out, pairs = window_prefill(q, k, v, ctx.q_start, self.config.sink, frac, rows)
        if self.tracer is not None:
            self.tracer(ctx, q, k, v, self.select_prefill(ctx, q, k, v), out)
        return out, pairs

    # ---- decode --------------------------------------------------------------------------------
    def decode_seq(self, ctx, q, k, v) -> tuple[torch.Tensor, float]:
        if self.use_cis or self.psaw_frac(ctx.layer) > 0:
            return super().decode_seq(ctx, q, k, v)
        return dense_attention(q[None], k, v)[0], float(ctx.n * k.shape[0])  # ETF; PSAW at layer l_s

    def select_decode(self, ctx, q, k, v) -> TokenSelection:
        n, sink = ctx.n, self.config.sink
        lo = max(window_start(self.psaw_frac(ctx.layer), n) - 1, 0)  # PSAW window [lo, n) plus sinks
        if self.use_cis:
            mask, retrieved, width = cis_step(self.config, ctx.state, q, k, lo)  # type: ignore[arg-type]
            self._retrievals[ctx.layer] = self._retrievals[ctx.layer] + retrieved.sum()
            self._head_steps[ctx.layer] += k.shape[0]
            return TokenSelection(indices_from_mask(mask, width), 1)
        dev = k.device
        idx = torch.cat([torch.arange(min(sink, n), device=dev), torch.arange(min(max(sink, lo), n), n, device=dev)])
        return TokenSelection(idx.to(torch.int32).unsqueeze(0).expand(k.shape[0], -1).contiguous(), 1)

    # ---- batched decode: PSAW's window and ETF's dense decode (CIS keeps per-sequence anchors) ------
    @property
    def batched_decode(self) -> bool:  # type: ignore[override]
        return not self.use_cis

    def dense_decode_layer(self, layer: int) -> bool:
        return self.is_dense_layer(layer) or self.psaw_frac(layer) == 0.0  # ETF, and PSAW at l_s: dense

    def _window_lo(self, layer: int, n: torch.Tensor) -> torch.Tensor:
        """Lowest visible non-sink key of the newest query of rows with n keys (``window_start`` in fp64)."""
        return window_lo(self.psaw_frac(layer), n - 1)

    def decode_select(self, layer: int, q: torch.Tensor, view: DecodeView) -> torch.Tensor:
        sink, width = self.config.sink, view.width_tokens
        n = view.seqlens.long()[:, None]
        start = torch.maximum(self._window_lo(layer, n), n.clamp(max=sink))
        widest = width - int(self._window_lo(layer, torch.tensor(width)))  # windows widen with n
        s_cols = torch.arange(min(sink, width), device=n.device)
        w_cols = torch.arange(min(widest, width), device=n.device)
        win = start + w_cols
        idx = torch.cat([torch.where(s_cols < n, s_cols, SENTINEL), torch.where(win < n, win, SENTINEL)], 1)
        return idx.to(torch.int32)[:, None, :].expand(-1, view.kv.k.shape[1], -1)

    def decode_keys(self, layer: int, n: int) -> int:
        lo = max(window_start(self.psaw_frac(layer), n) - 1, 0)
        return min(self.config.sink, n) + n - min(max(self.config.sink, lo), n)

    # ---- retrieval ratio -----------------------------------------------------------------------
    def retrieval_ratio_per_layer(self) -> list[float | None]:
        return [float(r) / s if s else None for r, s in zip(self._retrievals, self._head_steps, strict=True)]

    @property
    def retrieval_ratio(self) -> float | None:
        steps = sum(self._head_steps)
        return float(sum(float(r) for r in self._retrievals)) / steps if steps else None

    def reset_stats(self) -> None:
        self._retrievals = [0] * len(self._retrievals)
        self._head_steps = [0] * len(self._head_steps)


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


class CPE(PrHSMethod):
    name = "cpe"
    config_cls = CPEConfig
    use_cis = use_psaw = use_etf = True


register(method_spec(CIS, "PrHS CIS: per-head top-k retrieval shared across similar queries, dilated (decode)"))
register(method_spec(PSAW, "PrHS PSAW: sinks + depth-progressive sliding window from layer 3N/4 (prefill+decode)"))
register(method_spec(ETF, "PrHS ETF: early tokens frozen (attention and MLP skipped) from layer 3N/4 (prefill)"))
register(method_spec(CPE, "PrHS CPE: CIS + PSAW decode, PSAW + ETF prefill"))
