"""Delta attention: a prefill correction on top of any registered sparse prefill (docs/methods/delta.md).

For one sequence: O_sparse = the base method's prefill output; the anchor rows R = {i : i mod gamma == 0}
(absolute positions) are computed densely (query-sparse, key-dense) and written exactly, the other rows are
corrected from their anchor a = gamma floor(i / gamma), and the last ``n mod gamma + max(tail, gamma)`` queries of
the prompt are computed densely. Decode is the base method's decode. This module holds the method (``Delta``): its
base, the density budget it shares with it, decode and the prefill paths. The modes (``far-merge``, the default;
``delta-shrunk``; ``delta``, the published one; ``recompute``; ``sparse-only``), the fitted alpha, the density
accounting and the anchors: ``delta_correction.py`` (``DeltaCorrection``, the base of
``Delta``). The dense rows: ``delta_rows.py``; the configuration: ``delta_config.py``.

Choices the published method leaves open:
- ``density`` (``--density``) is met with Delta's dense rows inside it. It is forwarded to the base (the whole
  model's; the base turns it into its sparse layers' d); in prefill the base attends
  d_b = (d - f) / (1 - f) of the pairs, f = 1 / gamma + 1 / (gamma check_every) the share of a layer's causal
  pairs held by the anchors and check rows (1 / gamma for ``delta`` and ``recompute``), so that base plus dense
  rows attend d (the base's ``layer_density`` is swapped for d_b during Delta's prefill and its
  ``check_request``); decode is the base's at d. A density at or below f is refused at construction, one whose
  forced units plus f exceed it by ``check_request``. The dense tail's share (about 2 tail / n) depends on the
  prompt's length, so with a density the tail defaults to 0 and tail > 0 is refused; without a density the
  base keeps its own budget (streaming: sinks 64 + window 2048), the tail is the published 128, and the dense rows come
  on top (the reported density is the real one). ``dense_layers`` and ``block_size`` are forwarded too;
  ``base_params`` (dict or pairs) override all of them.
- Prefill runs on the batched seam when the base's does and its blocks are all it attends (streaming, quest,
  sketch_walk): the base selects the whole batch at its share of the budget, the shared varlen kernel attends it
  over the paged cache in place and returns the lse the far part merges against. The dense rows (1 / gamma of
  the rows, plus the check rows and the tail) are computed for the whole batch over the paged cache in place too
  (``delta_rows.PackedRows``: one ``dense_rows`` launch for every sequence's anchors with their far part, one for
  the check and tail rows), then each sequence is corrected by the same ``_correct`` as ``prefill_seq``.
- The tracer sees a ``DeltaSelection``: the base's BlockSelection plus which rows were computed densely.
- Prefix caching: none. The dense tail sits at the end of the prompt that computed a page, so a cached
  prefix's K/V depend on where that prompt ended; a prompt is always prefilled whole.
- No fallback to the base at its whole budget: the check rows measure a layer's attention-output error, which
  does not predict the error that reaches the model's output (docs/methods/delta.md says what was measured).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from raysparse.attention import causal_pairs
from raysparse.config import ModelConfig
from raysparse.kernels import dispatch
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods import baselines  # noqa: F401  - registers the default base, streaming
from raysparse.methods.base import SparseMethod, density_floor_error
from raysparse.methods.budget import prefill_floor
from raysparse.methods.delta_config import DeltaConfig, DeltaSelection
from raysparse.methods.delta_correction import DeltaCorrection
from raysparse.methods.delta_rows import PackedRows, SeqRows, row_indices
from raysparse.methods.registry import create_backend, method_spec, register
from raysparse.methods.selection import BlockSelection, block_pairs
from raysparse.methods.views import DecodeView, SeqContext


class Delta(DeltaCorrection):
    name = "delta"
    config_cls = DeltaConfig
    config: DeltaConfig
    # The dense tail is the last rows of the prompt (or chunk) that computed a page, so a cached prefix's
    # K/V depend on where that prompt ended: never reused from the prefix cache.
    prefix_state = "none"

    def __init__(self, model_cfg: ModelConfig, config: DeltaConfig | None = None) -> None:
        super().__init__(model_cfg, config)
        cfg = self.config
        params: dict[str, Any] = {"dense_layers": cfg.dense_layers, "block_size": cfg.block_size}
        if cfg.density is not None:  # the base turns the whole-model density into its layers' itself
            params["density"] = cfg.target_density if cfg.target_density is not None else cfg.density
        params.update(dict(cfg.base_params))
        base = create_backend(cfg.base, model_cfg, **params)
        if not isinstance(base, SparseMethod):
            raise ValueError(f"Delta needs a sparse prefill method as its base, got {cfg.base!r}")
        self.base = base
        # Honest density: with a density budget, the base's prefill gets what Delta's dense rows leave of it
        # (decode keeps the whole budget: Delta's decode is the base's).
        self.prefill_density: float | None = None
        d, share = base.layer_density, cfg.dense_share()
        if cfg.density is not None and d is not None and share > 0:
            if d <= share:
                raise ValueError(f"density {params['density']} gives a sparse layer {d:.4f} of its pairs, no more than "
                                 f"Delta's dense rows alone attend ({share:.4f}: anchors every {cfg.gamma} rows"
                                 + (f", check rows every {cfg.gamma * cfg.check_every}" if cfg.checks else "")
                                 + "); raise the density, gamma or check_every")
            self.prefill_density = (d - share) / (1 - share)

    @contextmanager
    def _base_tracer(self, fn) -> Iterator[None]:
        saved, self.base.tracer = self.base.tracer, fn
        try:
            yield
        finally:
            self.base.tracer = saved

    @contextmanager
    def _prefill_budget(self) -> Iterator[None]:
        """The base's prefill budget: its layer density less Delta's dense rows' share (``prefill_density``)."""
        if self.prefill_density is None:
            yield
            return
        saved, self.base.layer_density = self.base.layer_density, self.prefill_density
        try:
            yield
        finally:
            self.base.layer_density = saved

    def dense_seq(self, ctx, q, k, v) -> torch.Tensor:
        return self.base.dense_seq(ctx, q, k, v)

    def decode_seq(self, ctx, q, k, v) -> tuple[torch.Tensor, float]:
        with self._base_tracer(self.tracer):
            return self.base.decode_seq(ctx, q, k, v)

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self.base.release(seq_id)

    def wrapped_backends(self) -> tuple[SparseMethod, ...]:
        return (self.base,)

    def begin_step(self, cache: KVCache, batch: BatchMeta) -> None:
        """A prefill step's plans at the base's share of the budget, the density its selection runs at."""
        with self._prefill_budget() if batch.is_prefill else nullcontext():
            super().begin_step(cache, batch)

    def check_request(self, prompt_len: int, total_len: int) -> None:
        base = self.base
        try:
            with self._prefill_budget():  # the prefill at the base's share of the budget
                base.check_request(prompt_len, prompt_len)
        except ValueError:
            forced = base.prefill_forced_blocks
            if forced is None:
                raise
            share = self.config.dense_share()
            floor = share + (1 - share) * prefill_floor(prompt_len, forced, base.config.block_size)
            raise ValueError(density_floor_error(base, f"prefill (with Delta's dense rows, {share:.4f} of a layer's "
                                                       "pairs)", prompt_len, floor)) from None
        base.check_request(prompt_len, total_len)

    # ---- batched decode: the base's (Delta corrects prefill only) ---------------------------------
    @property
    def batched_decode(self) -> bool:  # type: ignore[override]
        return self.base.batched_decode and not self.base.row_state

    @property
    def decode_unit(self) -> int:  # type: ignore[override]
        return self.base.decode_unit

    def dense_decode_layer(self, layer: int) -> bool:
        return self.base.dense_decode_layer(layer)

    def decode_layer_class(self, layer: int) -> Hashable:
        return self.base.decode_layer_class(layer)

    def update_state(self, layer: int, cache: KVCache, batch: BatchMeta) -> None:
        self.base.update_state(layer, cache, batch)

    def graph_prepare(self, rows: list[int], cache: KVCache) -> None:
        self.base.graph_prepare(rows, cache)

    def decode_select(self, layer: int, q: torch.Tensor, view: DecodeView) -> torch.Tensor:
        return self.base.decode_select(layer, q, view)

    def decode_keys(self, layer: int, n: int) -> int:
        return self.base.decode_keys(layer, n)

    # ---- prefill ------------------------------------------------------------------------------------
    def _base_prefill(self, ctx: SeqContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, need_lse: bool
                      ) -> tuple[torch.Tensor, torch.Tensor | None, float, BlockSelection | None]:
        """The base's prefill at its share of the budget: out, lse (None unless ``need_lse``, or where the base
        reports no BlockSelection), attended pairs and its selection."""
        base = self.base
        with self._prefill_budget():
            if type(base).prefill_seq is SparseMethod.prefill_seq:  # select, then attend: the lse comes along
                sel = base.select_prefill(ctx, q, k, v)
                out, lse = dispatch.block_sparse_attention(q, k, v, sel)
                return out, lse, float(block_pairs(sel.indices, sel.block_size, ctx.q_start, ctx.n).sum()), sel
            seen: list[Any] = []
            with self._base_tracer(lambda *args: seen.append(args[4])):
                out, pairs = base.prefill_seq(ctx, q, k, v)
        sel = seen[-1] if seen and isinstance(seen[-1], BlockSelection) else None
        lse = dispatch.block_sparse_attention(q, k, v, sel)[1] if need_lse and sel is not None else None
        return out, lse, pairs, sel

    def prefill_seq(self, ctx: SeqContext, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> tuple[torch.Tensor, float]:
        o_sparse, lse_s, attended, base_sel = self._base_prefill(ctx, q, k, v, need_lse=self.config.mode == "far-merge")
        index = row_indices(self._row_sets, [(ctx.q_start, q.shape[0], ctx.n)], q.device)[0]
        out, dense, extra = self._correct(ctx, q, SeqRows(q, k, v, index), o_sparse, lse_s, attended, base_sel)
        extra = float(extra)
        if self.tracer is not None:
            sel = None if base_sel is None else DeltaSelection(base_sel.indices, base_sel.block_size, dense,
                                                               self.config.gamma, self.config.mode)
            self.tracer(ctx, q, k, v, sel, out)
        return out, attended + extra

    # ---- batched prefill: the base's packed selection and one varlen attend, then the dense rows ------------
    @property
    def batched_prefill(self) -> bool:  # type: ignore[override]
        """On the batched seam when the base is and its blocks are all it attends (the far part is the
        complement of those blocks): PrHS's bases add per-row windows in their own ``prefill_seq`` and keep
        the per-sequence path."""
        base = self.base
        return base.batched_prefill and type(base).prefill_seq is SparseMethod.prefill_seq

    def prefill_selects(self, layer: int, batch: BatchMeta) -> bool:
        return self.base.prefill_selects(layer, batch)

    def _prefill_batched(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        """The base selects the whole batch (at its share of the budget) and the shared varlen kernel attends it
        over the paged cache in place, with the lse the far part merges against. The dense rows of every
        sequence (anchors with their far part, check rows, tail) then come from one paged launch each
        (``PackedRows``), and each sequence is corrected from them as ``prefill_seq`` does."""
        view = self.prefill_view(layer, batch, cache)
        with self._prefill_budget():
            sel = self.base.prefill_select(layer, q, view)
        o_sparse, lse_s = dispatch.block_sparse_attention_varlen(q, view.kv, sel, view.cu_q_dev)
        base_pairs = self.base.prefill_pairs(view, sel)
        rows = PackedRows(self._row_sets, self.config.mode, self.config.gamma, q, view, sel)
        out = torch.empty_like(q)
        b, h_kv, start = sel.block_size, cache.num_kv_heads, 0
        extras = []
        for i, (n_q, n) in enumerate(zip(batch.q_lens, batch.ctx_lens, strict=True)):
            lo, hi = batch.cu_q[i], batch.cu_q[i + 1]
            blocks = (n - 1) // b - (n - n_q) // b + 1  # this sequence's query blocks in the packed selection
            one = BlockSelection(sel.indices[:, start:start + blocks], b)
            start += blocks
            # with the base's blocks the extra pairs are a device scalar and ``attended`` is not read
            out[lo:hi], _, extra = self._correct(view.context(i, self._seq_state), q[lo:hi], rows.of(i),
                                                 o_sparse[lo:hi], lse_s[lo:hi], math.nan, one)
            extras.append(torch.as_tensor(extra, dtype=torch.float64, device=q.device))
        # one host read for the layer's density, after all its work is queued
        pairs = (base_pairs.double() + torch.stack(extras)).tolist()
        for n_q, n, attended in zip(batch.q_lens, batch.ctx_lens, pairs, strict=True):
            self.meter.add(layer, attended, float(causal_pairs(n_q, n) * h_kv), decode=False)
        return out


register(method_spec(Delta, "Delta attention: dense anchor rows correct any sparse prefill (default streaming; "
                            "default mode far-merge, fitted and checked per head)"))
