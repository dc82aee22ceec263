"""Quest (``quest``, pages of ``page_size`` = 16), one of the baselines (conventions: ``baselines.py``; its doc:
docs/methods/baselines.md).

Per page and KV head the element-wise min m and max M of its keys live in ``ctx.state`` (dtype of K; min/max
are exact) and are extended as keys are appended (only the pages touched since the last call are recomputed).
The bound sum_d max(q_d m_d, q_d M_d) = q+ . M + q- . m is computed per query head and reduced over the group
by max. Decode keeps the first (sink) page and the current page plus the top pages, budget row_budget(density,
pages). Prefill (the paper has none; our variant): per query block, the mean of its valid queries stands in
for q, a key block's score is the max bound over its pages, and per row the top causal blocks are kept to
row_budget(density, causal blocks) besides the forced sink block 0 and the diagonal. The mean query is a
ranking heuristic, not a bound for every query of the block; ``block_size`` must be a multiple of
``page_size``.

The batched seams read the bounds per physical page (``page_pool``, kept by ``update_state``: ``page_bounds.py``,
which CIS's page retrieval shares), so a prompt starting from cached pages finds them there: decode scores pages
through the page table (``kernels/paged_quest.py``; on CPU tensors the scores and the list are one C call,
``kernels/cpu_quest.py``, as is the bounds' update), prefill scores every packed query block against the key
blocks straight from the pools (``kernels/quest_prefill.py``). ``select_prefill`` / ``select_decode`` over
gathered keys are the per-sequence references.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from raysparse.kernels.dispatch import (
    quest_block_scores,
    quest_decode_lists,
    quest_prefill_scores,
    select_list,
)
from raysparse.kernels.formats import PackedBlockSelection
from raysparse.kernels.scorer_reference import page_bounds, page_upper_bound
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods.base import MethodConfig, SparseMethod
from raysparse.methods.baselines import query_blocks, scalar_budget
from raysparse.methods.budget import prefill_block_budget, row_budget
from raysparse.methods.page_bounds import bound_pools, closing_rows, update_bounds
from raysparse.methods.registry import method_spec, register
from raysparse.methods.selection import BlockSelection, TokenSelection, indices_from_mask, topk_mask
from raysparse.methods.views import DecodeView, PrefillView, SeqContext


@dataclass(frozen=True)
class QuestStep:
    """What every sparse layer of one step reads (``Quest.plan_layers``). Prefill: the tokens whose Quest page
    the step's bounds update recomputes (``closing_rows``) and the packed lists' static widths
    (``list_widths``, None off the batched prefill); decode: each (row, KV head)'s page count k [B h_kv]."""

    closing_rows: torch.Tensor | None = None
    widths: tuple[int, int] | None = None
    decode_k: torch.Tensor | None = None


@dataclass(frozen=True)
class QuestConfig(MethodConfig):
    page_size: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.page_size <= 0 or self.page_size & (self.page_size - 1) or self.block_size % self.page_size:
            raise ValueError(f"page_size must be a power of two dividing block_size, got {self.page_size}")


class Quest(SparseMethod):
    name = "quest"
    config_cls = QuestConfig
    config: QuestConfig

    prefill_forced_blocks = 2  # the sink block and the diagonal

    def decode_forced_keys(self, n: int) -> int:
        p = self.config.page_size
        pages = -(-n // p)
        return n if pages <= 2 else p + n - (pages - 1) * p  # the first page and the current one

    def bounds(self, ctx: SeqContext, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Page bounds of the n keys, kept in ctx.state and extended with the pages touched since."""
        p, st, n = self.config.page_size, ctx.state, ctx.n
        done = st.get("quest_n", 0) if "quest_min" in st and st.get("quest_n", 0) <= n else 0
        first, pages = done // p, -(-n // p)
        lo, hi = page_bounds(k[:, first * p: n], p)
        if first == 0:
            st["quest_min"], st["quest_max"] = lo, hi
        else:
            cap = st["quest_min"].shape[1]
            if cap < pages:  # grow by doubling: amortised O(1) per appended key
                extra = max(cap, pages - cap)
                for key in ("quest_min", "quest_max"):
                    t = st[key]
                    st[key] = torch.cat([t, t.new_empty(t.shape[0], extra, t.shape[2])], 1)
            st["quest_min"][:, first:pages], st["quest_max"][:, first:pages] = lo, hi
        st["quest_n"] = n
        return st["quest_min"][:, :pages], st["quest_max"][:, :pages]

    def select_decode(self, ctx, q, k, v) -> TokenSelection:
        lo, hi = self.bounds(ctx, k)
        h_kv, pages, d = lo.shape
        score = page_upper_bound(q.float().view(h_kv, -1, 1, d), lo, hi)[:, 0]  # [h_kv, pages]
        forced = torch.zeros(pages, dtype=torch.bool, device=q.device)
        forced[0] = forced[-1] = True
        n_forced = 1 if pages == 1 else 2
        top = max(scalar_budget(self.layer_density, pages) - n_forced, 0)
        mask = topk_mask(score, top, torch.ones_like(score, dtype=torch.bool), forced.expand(h_kv, -1))
        return TokenSelection(indices_from_mask(mask, top + n_forced), self.config.page_size)

    # ---- batched decode over per-page bounds ------------------------------------------------------
    @property
    def decode_unit(self) -> int:  # type: ignore[override]
        return self.config.page_size

    def _pools(self, layer: int, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Per cache page, KV head and Quest page: the keys' element-wise min and max (``page_bounds``)."""
        return bound_pools(cache, layer, self.config.page_size)

    def plan_layers(self, cache: KVCache, batch: BatchMeta) -> QuestStep | None:
        """The step's row sets and budgets, functions of the batch's lengths alone and so the same at every
        sparse layer (one density): built once, before the layers."""
        if not self.sparse_layers():
            return None
        p = self.config.page_size
        if batch.is_prefill:
            widths = None
            if self.tracer is None and cache.page_size == self.config.block_size:
                widths = self.list_widths(batch.q_lens, batch.ctx_lens)
            return QuestStep(closing_rows=closing_rows(batch, p, batch.slot_offsets.device), widths=widths)
        if self.tracer is not None:
            return None
        n_pages = (cache.paged(0, batch)[0].seqlens.long() + p - 1) // p
        forced = torch.where(n_pages == 1, 1, 2)
        kk = (row_budget(self.layer_density, n_pages) - forced).clamp(min=0)  # [B]
        return QuestStep(decode_k=kk.repeat_interleave(cache.num_kv_heads))

    def update_state(self, layer: int, cache: KVCache, batch: BatchMeta) -> None:
        """Recomputes the bounds of each Quest page a step ends in (its keys up to the newest): a decode
        step's every row, and in prefill the tokens that close a Quest page or end a sequence's chunk."""
        rows = self.layer_plan(cache, batch).closing_rows if batch.is_prefill else None
        update_bounds(cache, layer, batch, self.config.page_size, rows)

    def _static_width(self, pages: int) -> int:
        """Entries of the widest row of a bucket of ``pages`` Quest pages: forced pages plus the budget."""
        return min(pages, max(scalar_budget(self.layer_density, pages), 2))

    def decode_select(self, layer: int, q: torch.Tensor, view: DecodeView) -> torch.Tensor:
        """The page scores (+inf: forced, the first and current page; -inf: past the row's pages) and each (row,
        KV head)'s list, ``quest_decode_lists`` (one C call on CPU tensors)."""
        p = self.config.page_size
        lo_pool, hi_pool = self._pools(layer, view.cache)
        kk = self.layer_plan(view.cache, view.batch).decode_k  # the lengths' alone: the step's (``plan_layers``)
        width = self._static_width(view.kv.page_table.shape[1] * (view.cache.page_size // p))
        return quest_decode_lists(q, lo_pool, hi_pool, view.kv.page_table, view.seqlens, p, kk, max(width - 2, 0),
                                  width)

    def decode_keys(self, layer: int, n: int) -> int:
        p = self.config.page_size
        pages = -(-n // p)
        forced = 1 if pages == 1 else 2
        chosen = min(pages, forced + max(scalar_budget(self.layer_density, pages) - forced, 0))
        return chosen * p - (pages * p - n)  # the current (last) page is always chosen

    def select_prefill(self, ctx, q, k, v) -> BlockSelection:
        lo, hi = self.bounds(ctx, k)
        return self._prefill_rows(ctx, q, lo, hi)

    def prefill_select(self, layer: int, q: torch.Tensor, view: PrefillView) -> PackedBlockSelection:
        """``select_prefill``'s rows for every query block of the batch at once, scored from the per-page bound
        pools (which ``update_state`` brought up to the step's newest keys) in place: no key is read again and no
        bounds are copied. Then one list selection over the packed rows (a row's budget depends on its block
        alone), ``select_list`` with the sink and the diagonal as +inf: ``_block_mask``'s choice and order
        (ties to the lower block), at the width ``indices_from_mask`` gives, with no host read."""
        b, p = self.config.block_size, self.config.page_size
        lo_pool, hi_pool = self._pools(layer, view.cache)
        rows = view.qblocks(b)
        qb, nkb = rows.qblock, -(-max(view.batch.ctx_lens) // b)
        args = (q, lo_pool, hi_pool, view.kv.page_table, view.kv.seqlens, view.cu_q_dev, rows.seq, qb, b, p, nkb)
        # [h_kv, R, nkb], -inf past each row's diagonal: those blocks are excluded.
        score = quest_prefill_scores(*args)
        return view.packed(self.packed_lists(score, qb, nkb, *self.layer_plan(view.cache, view.batch).widths), b)

    def packed_lists(self, score: torch.Tensor, qb: torch.Tensor, nkb: int, k_max: int, width: int) -> torch.Tensor:
        """Packed rows' block lists [h_kv, R, width] from their scores (overwritten: the sink and the diagonal
        become +inf)."""
        h_kv = score.shape[0]
        score[:, :, 0] = math.inf
        score.scatter_(2, qb.view(1, -1, 1).expand(h_kv, -1, 1), math.inf)
        b = self.config.block_size
        top = (prefill_block_budget(self.layer_density, qb, nkb - 1, 2, b) - torch.where(qb == 0, 1, 2)).clamp(min=0)
        return select_list(score.flatten(0, 1), top.repeat(h_kv), k_max, width).view(h_kv, -1, width)

    def list_widths(self, q_lens: list[int], ctx_lens: list[int]) -> tuple[int, int]:
        """The most candidates any row of a step picks and the most blocks any row lists (host arithmetic)."""
        b = self.config.block_size
        qb = torch.cat([torch.arange((n - m) // b, (n - 1) // b + 1) for m, n in zip(q_lens, ctx_lens, strict=True)])
        forced = torch.where(qb == 0, 1, 2)
        top = (prefill_block_budget(self.layer_density, qb, int(qb.max()), 2, b) - forced).clamp(min=0)
        return int(top.max()), int((forced + torch.minimum(top, qb + 1 - forced)).max())

    def _prefill_scores(self, ctx: SeqContext, q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's block scores [h_kv, nqb, nkb] from its bounds [h_kv, pages, d] (fp32), and its query
        blocks: the max bound over each key block's pages (-inf past n), of the mean of each query block's
        valid queries. The reference of ``kernels/quest_prefill.py``."""
        b = self.config.block_size
        h_kv, _, d = lo.shape
        qf, valid, qb = query_blocks(q, ctx, b)
        qmean = (qf * valid[..., None, None]).sum(1) / valid.sum(1).clamp(min=1)[:, None, None]  # [nqb, h, d]
        qmean = qmean.view(len(qb), h_kv, -1, d).permute(1, 2, 0, 3)  # [h_kv, g, nqb, d]
        return quest_block_scores(qmean, lo, hi, b, self.config.page_size, -(-ctx.n // b)), qb

    def _block_mask(self, score: torch.Tensor, qb: torch.Tensor, last_row: int) -> torch.Tensor:
        """The sink block and the diagonal, plus each row's top causal blocks by ``score`` to its budget."""
        b = self.config.block_size
        kb = torch.arange(score.shape[-1], device=score.device)[None, :]
        causal, forced = kb <= qb[:, None], (kb == 0) | (kb == qb[:, None])
        budget = prefill_block_budget(self.layer_density, qb, last_row, 2, b)
        top = (budget - torch.where(qb == 0, 1, 2)).clamp(min=0)
        return topk_mask(score, top, causal.expand_as(score), forced.expand_as(score))

    def _prefill_rows(self, ctx: SeqContext, q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> BlockSelection:
        score, qb = self._prefill_scores(ctx, q, lo, hi)
        return BlockSelection(indices_from_mask(self._block_mask(score, qb, (ctx.n - 1) // self.config.block_size)),
                              self.config.block_size)


register(method_spec(Quest, "Quest: page (16) min/max upper bound, top pages + sink + current page"))
