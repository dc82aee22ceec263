"""The PrHS methods' decode (``PrHSDecode``, the base of prhs.py's ``PrHSMethod``, over psaw_window.py's
``PSAWWindow``): which decode steps run dense (ETF's, and PSAW's at l_s), the per-sequence reference
(``select_decode``: CIS's ``cis_step`` over a sequence's state, else PSAW's window keys) and the batched seam.

- Batched CIS keeps per-row state (``cis_batched.py``'s ``CISBatchedState``, made at first use): placed by
  ``graph_prepare`` before each step, forgotten when a sequence is released or prefilled (prhs.py's
  ``prefill``: a sequence's state starts empty at its first decode step). Its selection's size is
  data-dependent (shared or retrieved sets), so density and retrieval counts are one host read of the counts
  the step wrote on the device, after the step (``_account_cis``: in ``decode`` for an eager step, in
  ``account_graph_decode`` after a replay). At layers >= l_s with PSAW (``cpe``) the step ranks and keeps
  only keys inside the window (``_window_lo``).
- Without CIS the batched selection is PSAW's window as token lists (``window_lists``), sized on the host
  (``decode_keys``).

The retrieval ratio rho is ``retrieval_ratio`` (overall) and ``retrieval_ratio_per_layer()`` on ``cis`` and
``cpe`` backends (``None`` before any step).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from raysparse.attention import dense_attention
from raysparse.config import ModelConfig
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods.cis import CISStepConsts, cis_step, cis_step_consts
from raysparse.methods.cis_batched import CISBatchedState, cis_batched_step
from raysparse.methods.page_bounds import bound_pools, closing_rows, update_bounds
from raysparse.methods.psaw import PrHSConfig, window_key_count, window_keys, window_lists, window_lo, window_start
from raysparse.methods.psaw_window import PSAWWindow
from raysparse.methods.selection import TokenSelection, indices_from_mask
from raysparse.methods.views import DecodeView


class PrHSDecode(PSAWWindow):
    """CIS, PSAW and ETF's decode, per sequence and batched, with CIS's retrieval counts (``PrHSMethod``, in
    prhs.py, switches the components on and says where PSAW acts: ``psaw_frac``)."""

    use_psaw = False

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

    @property
    def selection_reads_keys(self) -> bool:  # type: ignore[override]
        return self.use_cis  # CIS's retrieval scores read every key (or, by pages, the chosen pages' keys)

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

    def plan_layers(self, cache: KVCache, batch: BatchMeta) -> CISStepConsts | None:
        """CIS's per-step constants (``CISStepConsts``: the rows' lengths and budgets at the step's width), the
        same at every CIS layer: built once before the layers. None off CIS's batched decode."""
        if batch.is_prefill or not (self.use_cis and self.batched_decode and self.tracer is None):
            return None
        kv, _ = cache.paged(0, batch)
        return cis_step_consts(self.config, kv.seqlens.long(), kv.page_table.shape[1] * cache.page_size,  # type: ignore
                               cache.num_kv_heads)

    def decode(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        eager = (self.use_cis and self.batched_decode and self.tracer is None and not batch.extras.get("graph")
                 and not self.dense_decode_layer(layer))
        out = super().decode(layer, q, cache, batch)
        if eager:
            self._account_cis([layer], batch.ctx_lens, cache.num_kv_heads)
        return out

    def decode_layer_class(self, layer: int) -> Hashable:
        return self.dense_decode_layer(layer), self.psaw_frac(layer)  # PSAW's window narrows with depth

    def _meter_decode(self, layer: int, ctx_lens: list[int], num_kv_heads: int,
                      memo: dict[Hashable, int] | None = None) -> None:
        if self.use_cis and not self.dense_decode_layer(layer):
            return  # data-dependent (shared or retrieved sets): ``_account_cis`` reads the step's count
        super()._meter_decode(layer, ctx_lens, num_kv_heads, memo)

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
        buf = state.rows(len(state.current or ())).counts
        # A replayed step's layers are every CIS layer, in order: a slice, where a list index would copy the list
        # to the device (a pageable copy, which waits for the step) before the one read of the counts.
        picked = buf[idx[0]: idx[-1] + 1] if idx == list(range(idx[0], idx[-1] + 1)) else buf[idx]
        counts = picked[:, : len(ctx_lens)].sum((1, 2)).tolist()
        causal = float(sum(ctx_lens) * num_kv_heads)
        for layer, (keys, retrieved) in zip(layers, counts, strict=True):
            self.meter.add(layer, float(keys), causal, decode=True)
            self._retrievals[layer] = self._retrievals[layer] + retrieved
            self._head_steps[layer] += len(ctx_lens) * num_kv_heads

    def step_keys(self, layer: int) -> list[int]:
        """CIS: keys each row of the last batched step attended at this layer, summed over KV heads."""
        state = self._cis
        assert state is not None and state.current is not None, "no batched CIS step has run"
        return state.rows(len(state.current)).counts[state.index[layer], :, :, 0].sum(-1).tolist()

    def release(self, seq_id: int) -> None:
        if self._cis is not None:
            self._cis.forget(seq_id)
        super().release(seq_id)

    def _window_lo(self, layer: int, n: torch.Tensor) -> torch.Tensor:
        """Lowest visible non-sink key of the newest query of rows with n keys (``window_start`` in fp64)."""
        return window_lo(self.psaw_frac(layer), n - 1)

    @property
    def _page_retrieval(self) -> bool:
        """CIS retrieving by pages (``cis_pages.py``): it keeps per-page key bounds (``page_bounds.py``)."""
        return self.use_cis and self.config.retrieval == "pages"  # type: ignore[attr-defined]

    def update_state(self, layer: int, cache: KVCache, batch: BatchMeta) -> None:
        """The page retrieval's bounds of each Quest page the step's tokens end in (``page_bounds.update_bounds``);
        a prefill step's closing rows are the step's, found once for its layers."""
        if not self._page_retrieval:
            return
        page, rows = self.config.retrieval_page, None  # type: ignore[attr-defined]
        if batch.is_prefill:
            key = ("cis-closing-rows", id(self))
            rows = batch.extras.get(key)
            if rows is None:
                rows = batch.extras[key] = closing_rows(batch, page, batch.slot_offsets.device)
        update_bounds(cache, layer, batch, page, rows)

    def decode_select(self, layer: int, q: torch.Tensor, view: DecodeView) -> torch.Tensor:
        if self.use_cis:
            state, wt = self._cis_state(view.cache), view.width_tokens
            consts = self.layer_plan(view.cache, view.batch)  # the step's, built before the layers
            bounds = bound_pools(view.cache, layer, self.config.retrieval_page) if self._page_retrieval else None  # type: ignore
            lo = None
            if self.use_psaw:  # the step's lengths from its constants: no cast a layer in the captured step
                lo = self._window_lo(layer, consts.n if consts is not None else view.seqlens.long())
            return cis_batched_step(self.config, state.rows(q.shape[0]), state.index[layer], q,  # type: ignore
                                    view.kv, wt, lo, consts, bounds=bounds)
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

    def item_sums(self) -> dict[str, Any]:
        if not self.use_cis:
            return {}
        return {"cis": ([float(r) for r in self._retrievals], [float(s) for s in self._head_steps])}
