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

from dataclasses import dataclass, replace

import torch

from raysparse.attention import causal_pairs, dense_attention
from raysparse.config import ModelConfig
from raysparse.kernels.formats import PackedBlockSelection
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods.base import DecodeView, PrefillView, SeqContext, method_spec
from raysparse.methods.cis import CISConfig, cis_step
from raysparse.methods.cis_batched import CISBatchedState, cis_batched_step, cis_step_consts
from raysparse.methods.etf import ETFConfig, etf_fraction, frozen_mask, frozen_span
from raysparse.methods.psaw import (
    PrHSConfig,
    PSAWConfig,
    covering_blocks,
    depth_fraction,
    start_layer,
    visible_pairs,
    window_key_count,
    window_keys,
    window_lists,
    window_lo,
    window_prefill,
    window_start,
)
from raysparse.methods.psaw_window import PSAWWindow
from raysparse.methods.registry import register
from raysparse.methods.selection import BlockSelection, TokenSelection, indices_from_mask


@dataclass(frozen=True)
class CPEConfig(CISConfig, PSAWConfig, ETFConfig):
    """All of CIS, PSAW and ETF's fields (one shared ``sink`` and ``start_layer``)."""


class PrHSMethod(PSAWWindow):
    """The composition; subclasses switch components on (PSAWWindow: PSAW's window seams)."""

    use_cis = use_psaw = use_etf = False
    config: PrHSConfig

    def __init__(self, model_cfg: ModelConfig, config: PrHSConfig | None = None) -> None:
        super().__init__(model_cfg, config)
        layers = model_cfg.num_layers
        self._retrievals: list[torch.Tensor | int] = [0] * layers
        self._head_steps = [0] * layers
        self._cis: CISBatchedState | None = None  # the batched decode's per-row CIS state, made at first use

    def decode_forced_keys(self, n: int) -> int | None:
        if not self.use_cis or self.use_psaw:  # PSAW's window is its own budget
            return None
        c = self.config
        sink = min(c.sink, n)
        return sink + min(c.local, n - sink)  # type: ignore[attr-defined]

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
        if not batch.is_prefill or frac <= 0:
            return None
        key = ("etf-frozen", layer)  # asked by the model and by the batched selection: built once
        if key not in batch.extras:
            batch.extras[key] = frozen_mask(frac, self.config.sink, batch)
        return batch.extras[key]

    # ---- prefill -------------------------------------------------------------------------------
    def prefill(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        if self._cis is not None and layer == 0:
            for sid in batch.seq_ids:  # the batched CIS state starts empty at a sequence's first decode step
                self._cis.forget(sid)
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
        idx = window_keys(self.psaw_frac(ctx.layer), sink, n, k.device)
        return TokenSelection(idx.to(torch.int32).unsqueeze(0).expand(k.shape[0], -1).contiguous(), 1)

    # ---- batched decode: PSAW's window, ETF's dense decode, CIS over per-row state (cis.py) ----------------
    def dense_decode_layer(self, layer: int) -> bool:
        # ETF, and PSAW at l_s: dense; CIS selects on every sparse layer.
        return self.is_dense_layer(layer) or (not self.use_cis and self.psaw_frac(layer) == 0.0)

    @property
    def row_state(self) -> bool:  # type: ignore[override]
        return self.use_cis

    def _cis_state(self, cache: KVCache) -> CISBatchedState:
        if self._cis is None:
            mc = self.model_cfg
            self._cis = CISBatchedState(self.config, self.sparse_layers(),  # type: ignore[arg-type]
                                        mc.num_heads // mc.num_kv_heads * mc.head_dim,
                                        min(cache.capacity_tokens, mc.max_position_embeddings))
        return self._cis

    def graph_prepare(self, rows: list[int], cache: KVCache) -> None:
        if self.use_cis:
            self._cis_state(cache).prepare(rows, cache)
        else:
            super().graph_prepare(rows, cache)

    def decode(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        eager = (self.use_cis and self.batched_decode and self.tracer is None and not batch.extras.get("graph")
                 and not self.dense_decode_layer(layer))
        out = super().decode(layer, q, cache, batch)
        if eager:
            self._account_cis([layer], batch.ctx_lens, cache.num_kv_heads)
        return out

    def _meter_decode(self, layer: int, ctx_lens: list[int], num_kv_heads: int) -> None:
        if self.use_cis and not self.dense_decode_layer(layer):
            return  # data-dependent (shared or retrieved sets): ``_account_cis`` reads the step's count
        super()._meter_decode(layer, ctx_lens, num_kv_heads)

    def account_graph_decode(self, ctx_lens: list[int], num_kv_heads: int) -> None:
        super().account_graph_decode(ctx_lens, num_kv_heads)
        if self.use_cis:
            self._account_cis(list(self.sparse_layers()), ctx_lens, num_kv_heads)

    def _account_cis(self, layers: list[int], ctx_lens: list[int], num_kv_heads: int) -> None:
        """Density and retrieval counts of the step just run at these CIS layers, for its real rows (the first
        len(ctx_lens)): one host read of the counts the step wrote on the device, after the step."""
        state = self._cis
        if state is None or not layers:
            return
        idx = [state.index[layer] for layer in layers]
        counts = state.rows(len(state.current or ())).counts[idx, : len(ctx_lens)].sum(1).tolist()
        causal = float(sum(ctx_lens) * num_kv_heads)
        for layer, (keys, retrieved) in zip(layers, counts, strict=True):
            self.meter.add(layer, float(keys), causal, decode=True)
            self._retrievals[layer] = self._retrievals[layer] + retrieved
            self._head_steps[layer] += len(ctx_lens) * num_kv_heads

    def step_keys(self, layer: int) -> list[int]:
        """CIS: keys each row of the last batched step attended at this layer, summed over KV heads."""
        state = self._cis
        assert state is not None and state.current is not None, "no batched CIS step has run"
        return state.rows(len(state.current)).counts[state.index[layer], :, 0].tolist()

    def release(self, seq_id: int) -> None:
        if self._cis is not None:
            self._cis.forget(seq_id)
        super().release(seq_id)

    def _window_lo(self, layer: int, n: torch.Tensor) -> torch.Tensor:
        """Lowest visible non-sink key of the newest query of rows with n keys (``window_start`` in fp64)."""
        return window_lo(self.psaw_frac(layer), n - 1)

    def decode_select(self, layer: int, q: torch.Tensor, view: DecodeView) -> torch.Tensor:
        if self.use_cis:
            state, n, wt = self._cis_state(view.cache), view.seqlens.long(), view.width_tokens
            key = ("cis-step", wt)  # built by the step's first CIS layer, read by the rest
            consts = view.batch.extras.get(key)
            if consts is None:
                consts = view.batch.extras[key] = cis_step_consts(self.config, n, wt, view.kv.k.shape[1])  # type: ignore
            return cis_batched_step(self.config, state.rows(q.shape[0]), state.index[layer], q,  # type: ignore
                                    view.kv, wt, self._window_lo(layer, n) if self.use_psaw else None, consts)
        lists = window_lists(self.psaw_frac(layer), self.config.sink, view.seqlens, view.width_tokens)
        return lists[:, None, :].expand(-1, view.kv.k.shape[1], -1)

    def decode_keys(self, layer: int, n: int) -> int:
        if self.use_cis:
            raise NotImplementedError("CIS's selection size is data-dependent: the step counts it (step_keys)")
        return window_key_count(self.psaw_frac(layer), self.config.sink, n)

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
