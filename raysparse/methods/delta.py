"""Delta attention (SPEC section 2): a prefill correction on top of any registered sparse prefill.

For one sequence: O_sparse = the base method's prefill output; the anchor rows R = {i : i mod gamma == 0}
(absolute positions) are computed densely (query-sparse, key-dense) and written exactly, the other rows are
corrected from their anchor a = gamma floor(i / gamma), and the last ``n mod gamma + max(tail, gamma)`` queries of
the prompt are computed densely. Decode is the base method's decode. The modes:

- ``far-merge`` (the default): the anchor's attention over its causal keys OUTSIDE the base's selection (its
  "far" part: output O_far(a), log-mass lse_far(a) and mean key kbar(a) under those weights) is merged into each
  row's own sparse attention (O_sparse(i), lse_sparse(i), from the base's kernel) by log-sum-exp, with the row's
  far log-mass estimated to first order, lse_far(a) + (q_i - q_a) . kbar(a) / sqrt(d) (a lower bound: lse is
  convex in q). So the correction is D_pred(i) = w(i) (O_far(a) - O_sparse(i)), w(i) = the estimated far share
  of row i's attention. A block-level base attends the same key blocks for every row of a query block, so with
  gamma = block_size the anchor's far keys are exactly its rows' far keys; only the queries differ. A base that
  reports no BlockSelection has no far part: this mode then uses the paper's difference (``delta-shrunk``).
- ``delta-shrunk``: the paper's D_pred(i) = O_dense(a) - O_sparse(a), scaled by the fitted alpha.
- ``delta``: SPEC's and the paper's formula as written, O[i] = O_sparse[i] + (O_dense(a) - O_sparse(a)).
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

Choices where SPEC is silent:
- ``density`` (``--density``) is met with Delta's dense rows inside it. It is forwarded to the base (the whole
  model's; the base turns it into its sparse layers' d); in prefill the base attends
  d_b = (d - f) / (1 - f) of the pairs, f = 1 / gamma + 1 / (gamma check_every) the share of a layer's causal
  pairs held by the anchors and check rows (1 / gamma for ``delta`` and ``recompute``), so that base plus dense
  rows attend d (the base's ``layer_density`` is swapped for d_b during Delta's prefill and its
  ``check_request``); decode is the base's at d. A density at or below f is refused at construction, one whose
  forced units plus f exceed it by ``check_request``. The dense tail's share (about 2 tail / n) depends on the
  prompt's length, so with a density the tail defaults to 0 and tail > 0 is refused; without a density the
  base keeps its own budget (streaming: sinks 64 + window 2048), the tail is SPEC's 128, and the dense rows come
  on top (the reported density is the real one). ``dense_layers`` and ``block_size`` are forwarded too;
  ``base_params`` (dict or pairs) override all of them.
- Density accounting counts the union: attended = base pairs + sum over the dense rows of (causal keys of the
  row - keys the base already attended in that row), read from the base's BlockSelection. A base that reports
  none falls back to min(base pairs + dense pairs, causal pairs), an upper bound.
- Anchors stay SPEC's R (the first row of each gamma-block): a row's anchor is then never after it, so a chunked
  prefill gives the whole prompt's output (rows before a chunk's first anchor use the previous chunk's anchor,
  carried in Delta's per-sequence state, as does the fit). The tail is the last rows of each chunk.
- Prefill runs on the batched seam when the base's does and its blocks are all it attends (streaming, quest,
  sketch_walk): the base selects the whole batch at its share of the budget, the shared varlen kernel attends it
  over the paged cache in place and returns the lse the far part merges against. The dense rows (1 / gamma of
  the rows, plus the check rows and the tail) are computed for the whole batch over the paged cache in place too
  (``delta_rows.PackedRows``: one ``dense_rows`` launch for every sequence's anchors with their far part, one for
  the check and tail rows), then each sequence is corrected by the same ``_correct`` as ``prefill_seq``.
- The tracer sees a ``DeltaSelection``: the base's BlockSelection plus which rows were computed densely.
- Prefix caching: none. The dense tail sits at the end of the prompt that computed a page, so a cached
  prefix's K/V depend on where that prompt ended; a prompt is always prefilled whole.

Measured on the default model (SmolLM2-135M, CPU, 2026-11-25; BENCHMARKS.md "Delta that helps"):
- The paper's premise fails here: a row's true correction D(i) has cosine ~0.4 with its anchor's, and reusing it
  raises the output error of every layer (after / before at 4096 tokens: 1.9 over the block-level streaming
  base, whose anchor row has the smallest window of its block; 1.15 over a token-level window as in the
  paper). ``delta`` raises perplexity: 28.19 -> 39.94 at 7680 tokens, density 0.15. ``delta-shrunk`` detects
  it: alpha 0.15, 38% of the heads fall back, check-row error ratio 0.93.
- Other predictors, per layer on the dense run's q, k, v at 4096 tokens, density 0.15 (``probe_delta.py
  --diagnose --variants``), error ratio of the rows not computed: the paper's difference from mid-block anchors
  1.13; linear interpolation between dense rows every 32 1.33; the paper's difference with the fitted alpha
  0.95; far-merge without the first-order term 1.50; far-merge 0.78 (0.75 with the mid-block row of the row's
  own query block as anchor, which a chunk may not have yet); far-merge with the row's exact far output (not
  computable cheaply) 0.65. Letting alpha reach 2 gained nothing (scratch measurement).
- far-merge keeps alpha ~0.98 (no head falls back) with check-row error ratio 0.72-0.75, but at the same base
  budget (dense rows on top) it lowers the KL to dense by only 6-7% (streaming) and 3-11% (Sketch&Walk), and at
  the same real density its dense rows (1.7% of a sparse layer's pairs, ~19% of its budget at density 0.15)
  cost the base more than the correction returns: perplexity 28.54 against streaming's 28.19 and Sketch&Walk's
  27.59 against Delta over it 28.01 at 7680 tokens. Issue 16's ">= 50% of the gap" is not reached.
- No fallback to the base at its whole budget: the check rows cannot tell when one is needed. Per layer
  (teacher-forced, 4096 tokens, density 0.15), Delta's output error is 0.67-0.97x that of the base alone at
  the whole budget in every layer, the early layers gaining most; yet Delta in layer 2 or 5 alone raises
  perplexity and KL end to end, while in layers 20 or 29 it is neutral (``benchmarks/probe_delta_layers.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from raysparse.attention import causal_pairs
from raysparse.config import ModelConfig
from raysparse.kernels import dispatch
from raysparse.kernels.reference import (
    strided_dense_attention,  # noqa: F401 - re-exported
)
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods import baselines  # noqa: F401  - registers the default base, streaming
from raysparse.methods.base import (
    DecodeView,
    MethodConfig,
    PrefillView,
    SeqContext,
    SparseMethod,
    density_floor_error,
    method_spec,
    prefill_floor,
)
from raysparse.methods.delta_rows import PackedRows, Rows, SeqRows, far_merge_prediction, fit_summary
from raysparse.methods.registry import create_backend, register
from raysparse.methods.selection import SENTINEL, BlockSelection, block_pairs

MODES = ("far-merge", "delta-shrunk", "delta", "recompute", "sparse-only")
FITTED = ("far-merge", "delta-shrunk")  # the modes whose correction is scaled by alpha
SPEC_TAIL = 128  # SPEC's dense tail: the last n mod gamma + max(128, gamma) queries
FALLBACK_ALPHA = 0.05  # a head whose fitted alpha is below this counts as fallen back (stats)
NOISE = 1e-5  # a predicted correction below this fraction of a check row's output is no evidence for alpha
NOISE_ROUNDINGS = 8  # ... nor one below this many unit roundoffs of the attends that computed it


@dataclass(frozen=True)
class DeltaSelection(BlockSelection):
    """What the tracer sees: the base's selection, and the rows (of this call) computed densely."""

    dense_rows: torch.Tensor  # bool [n_q]
    gamma: int
    mode: str


@dataclass(frozen=True)
class DeltaConfig(MethodConfig):
    density: float | None = None  # None: the base's own budget; set: Delta's dense rows and the base share it
    gamma: int = 64
    mode: str = "far-merge"
    tail: int | None = None  # dense tail = n mod gamma + max(tail, gamma) queries; None: 128 without a density, 0
    # with one; 0 disables it
    # Check rows gamma j + gamma // 2 of the first check_every gamma-blocks j (early evidence, few keys) and then
    # of one block in check_every; 0: none (alpha 1)
    check_every: int = 16
    alpha: float | None = None  # the correction's scale: None fits it per head on the check rows; a number fixes it
    base: str = "streaming"
    base_params: Any = ()  # dict or (key, value) pairs for the base

    def __post_init__(self) -> None:
        if self.density is None:  # validates the shared fields
            MethodConfig(1.0, self.dense_layers, self.block_size, self.target_density)
        else:
            super().__post_init__()
        if isinstance(self.base_params, dict):
            object.__setattr__(self, "base_params", tuple(sorted(self.base_params.items())))
        object.__setattr__(self, "base_params", tuple((str(a), b) for a, b in self.base_params))
        if self.gamma < 1 or (self.tail is not None and self.tail < 0) or self.check_every < 0:
            raise ValueError(f"need gamma >= 1, tail >= 0 and check_every >= 0, got {self.gamma}, {self.tail}, "
                             f"{self.check_every}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1] or unset, got {self.alpha}")
        if self.base == "delta":
            raise ValueError("Delta cannot wrap itself")
        if self.density is not None and self.tail:
            raise ValueError("a dense tail (tail > 0) cannot share a density budget: its share of a prefill's pairs "
                             "(about 2 tail / n) depends on the prompt's length; leave tail unset (0 with --density) "
                             "or leave the density unset")

    @property
    def tail_len(self) -> int:
        """The dense tail's ``tail`` in effect: SPEC's 128 without a density budget, none with one."""
        if self.tail is not None:
            return self.tail
        return SPEC_TAIL if self.density is None else 0

    def tail_rows(self, n: int) -> int:
        return n % self.gamma + max(self.tail_len, self.gamma) if self.tail_len and self.mode != "sparse-only" else 0

    @property
    def checks(self) -> bool:
        """Whether check rows are computed (a fitted correction)."""
        return self.mode in FITTED and self.alpha is None and self.check_every > 0 and self.gamma > 1

    @property
    def check_offset(self) -> int:
        return self.gamma // 2

    def dense_share(self) -> float:
        """The share of a sparse layer's causal pairs that the strided dense rows (anchors and check rows) hold,
        for a long prompt (anchors every gamma rows hold 1 / gamma of them, check rows 1 / (gamma check_every))."""
        if self.mode == "sparse-only":
            return 0.0
        share = 1.0 / self.gamma
        if self.checks:
            share += 1.0 / (self.gamma * self.check_every)
        return share


class Delta(SparseMethod):
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
        self.reset_stats()

    # ---- statistics: the fitted correction per layer ----------------------------------------------
    def reset_stats(self) -> None:
        n = self.model_cfg.num_layers
        self._alpha_sum, self._heads, self._fell = [0.0] * n, [0] * n, [0] * n
        self._chk_before, self._chk_after = [0.0] * n, [0.0] * n

    def fit_sums(self) -> tuple[list[float], ...]:
        """The additive sums behind ``stats_dict`` (per layer; summed over requests, items and TP shards)."""
        return (list(self._alpha_sum), [float(h) for h in self._heads], [float(f) for f in self._fell],
                list(self._chk_before), list(self._chk_after))

    def stats_dict(self) -> dict[str, Any]:
        return {"mode": self.config.mode, **fit_summary(*self.fit_sums())}

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
        out, dense, extra = self._correct(ctx, q, SeqRows(q, k, v), o_sparse, lse_s, attended, base_sel)
        if self.tracer is not None:
            sel = None if base_sel is None else DeltaSelection(base_sel.indices, base_sel.block_size, dense,
                                                               self.config.gamma, self.config.mode)
            self.tracer(ctx, q, k, v, sel, out)
        return out, attended + extra

    def _row_sets(self, q_start: int, n_q: int, n: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """One call's dense rows, local to its n_q rows: the anchors (absolute positions 0 mod gamma; a short chunk
        may hold none), the check rows (empty unless the correction is fitted on them) and the first tail row
        (n_q: no tail)."""
        cfg, gamma = self.config, self.config.gamma
        first = (-q_start) % gamma
        anchors = torch.arange(min(first, n_q), n_q, gamma, device=device)
        checks = torch.zeros(0, dtype=torch.long, device=device)
        if cfg.mode in FITTED and cfg.alpha is None and cfg.checks:
            g, off, every = gamma, cfg.check_offset, cfg.check_every
            pos = q_start + torch.arange(n_q, device=device)
            blk = torch.div(pos, g, rounding_mode="floor")
            checks = ((pos % g == off) & ((blk < every) | (blk % every == every - 1))).nonzero()[:, 0]
        tail_lo = max(n - cfg.tail_rows(n), q_start) - q_start
        return anchors, checks, min(tail_lo, n_q)

    def _correct(self, ctx: SeqContext, q: torch.Tensor, rows: Rows, o_sparse: torch.Tensor,
                 lse_s: torch.Tensor | None, attended: float, base_sel: BlockSelection | None
                 ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One sequence's corrected output from the base's (``o_sparse``, its lse and selection; ``attended``:
        the base's pairs), its dense rows taken from ``rows``: the output, which rows were computed densely, and
        the causal pairs those rows add."""
        cfg, gamma = self.config, self.config.gamma
        far = cfg.mode == "far-merge" and lse_s is not None and base_sel is not None  # else: the paper's difference
        n_q, n = q.shape[0], ctx.n
        pos = ctx.q_start + torch.arange(n_q, device=q.device)
        dense = torch.zeros(n_q, dtype=torch.bool, device=q.device)
        if cfg.mode == "sparse-only":
            return o_sparse, dense, 0.0
        first = (-ctx.q_start) % gamma
        anchors, checks_at, tail_lo = self._row_sets(ctx.q_start, n_q, n, q.device)
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
            alpha, checks = self._alpha(ctx, q, pos, out, pred, rows, checks_at)
            out = out + (pred if alpha is None else alpha[..., None] * pred)
        out[anchors] = o_rows
        dense[anchors] = True
        if checks is not None:
            out[checks[0]] = checks[1]
            dense[checks[0]] = True
        if tail_lo < n_q:
            tail = torch.arange(tail_lo, n_q, device=q.device)
            out[tail_lo:] = rows.dense(tail, pos[tail])
            dense[tail_lo:] = True
        extra = self._extra_pairs(base_sel, pos[dense], rows.h_kv, n, ctx.q_start, attended)
        return out.to(q.dtype), dense, extra

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
        view = PrefillView.of(layer, batch, cache)
        with self._prefill_budget():
            sel = self.base.prefill_select(layer, q, view)
        o_sparse, lse_s = dispatch.block_sparse_attention_varlen(q, view.kv, sel, view.cu_q_dev)
        base_pairs = self.base.prefill_pairs(view, sel).tolist()  # one sync
        rows = PackedRows(self._row_sets, self.config.mode, self.config.gamma, q, view, sel)
        out = torch.empty_like(q)
        b, h_kv, start = sel.block_size, cache.num_kv_heads, 0
        for i, (n_q, n) in enumerate(zip(batch.q_lens, batch.ctx_lens, strict=True)):
            lo, hi = batch.cu_q[i], batch.cu_q[i + 1]
            blocks = (n - 1) // b - (n - n_q) // b + 1  # this sequence's query blocks in the packed selection
            one = BlockSelection(sel.indices[:, start:start + blocks], b)
            start += blocks
            out[lo:hi], _, extra = self._correct(view.context(i, self._seq_state), q[lo:hi], rows.of(i),
                                                 o_sparse[lo:hi], lse_s[lo:hi], float(base_pairs[i]), one)
            self.meter.add(layer, base_pairs[i] + extra, float(causal_pairs(n_q, n) * h_kv), decode=False)
        return out

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
        self._chk_before[layer] += float((d_true * d_true).sum())
        self._chk_after[layer] += float(((d_true - fitted[:-1, :, None] * d_pred) ** 2).sum())
        self._alpha_sum[layer] += float(fitted[-1].sum())
        self._heads[layer] += h
        self._fell[layer] += int((fitted[-1] < FALLBACK_ALPHA).sum())
        return alpha, (ci, o_chk)

    def _extra_pairs(self, sel: BlockSelection | None, rows: torch.Tensor, h_kv: int, n: int,
                     q_start: int, base_pairs: float) -> float:
        """Causal pairs of the dense rows (absolute positions ``rows``) the base did not attend."""
        dense_pairs = float((rows + 1).sum()) * h_kv
        if sel is None:
            return max(0.0, min(dense_pairs, causal_pairs(n - q_start, n) * h_kv - base_pairs))
        b = sel.block_size
        kb = sel.indices[:, rows // b - q_start // b].long()  # [h_kv, |D|, S]
        lo = kb * b
        hi = torch.minimum(lo + b, rows[None, :, None] + 1)
        covered = ((hi - lo).clamp(min=0) * (kb != SENTINEL)).sum()
        return dense_pairs - float(covered)


def _carries(ctx: SeqContext) -> dict[str, Any]:
    """What Delta carries from one prefill chunk to the next at ``ctx``'s layer (the last anchor's rows, the
    fit's sums). Kept in Delta's own per-sequence state, not in the layer's metadata slot (``ctx.state``),
    which belongs to the base: a base may replace it whole at each step."""
    return ctx.seq_state.setdefault(("delta", ctx.layer), {})


register(method_spec(Delta, "Delta attention: dense anchor rows correct any sparse prefill (default streaming; "
                            "default mode far-merge, fitted and checked per head)"))
