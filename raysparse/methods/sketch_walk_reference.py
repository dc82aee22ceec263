"""Sketch&Walk's per-sequence path, the reference: ``ReferenceSelection``, the mixin of ``SketchWalk`` that
holds one sequence's block sketches (kept in the cache's metadata slot of each layer), its sketched block
scores and the heads' combine, the forced + top-k choice of blocks (or, at decode, of key parts), and the
``select_prefill`` / ``select_decode`` / ``prefill_select_per_sequence`` seams built on them. The walk across
layers is ``sketch_walk_walk``'s.

It serves the modes the batched paths do not (the walks that chain layers, the published head mean, a decode with
``graph_paired`` False or no room for the batched state) and is their test oracle; the
batched paths reuse its pieces (``_scores`` for the prefix cache's A_hat rows, ``_combine_heads`` /
``head_partial`` in the paired decode and the batched prefill, so that every path combines heads alike).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from raysparse.kernels.formats import PackedBlockSelection
from raysparse.kv_cache import KVCache
from raysparse.methods.budget import host_row_budget, prefill_block_budget, row_budget
from raysparse.methods.selection import BlockSelection, TokenSelection, indices_from_mask, topk_mask
from raysparse.methods.sketch_walk_prefix import adopt_prefix, store_prefix
from raysparse.methods.sketch_walk_walk import block_counts, walk_rows
from raysparse.methods.views import PrefillView, SeqContext

if TYPE_CHECKING:  # what this path reads of the method (set by ``SketchWalk`` and ``SparseMethod``), declared once
    from raysparse.methods.sketch_walk_method import SketchWalkMethod as _Method
else:
    _Method = object


class ReferenceSelection(_Method):
    """Sketch&Walk's per-sequence sketches, scores and selection; mixed into ``SketchWalk`` (before
    ``SparseMethod``, whose ``select_prefill`` / ``select_decode`` it provides)."""

    _seq_state: dict[int, dict[str, Any]]

    # ---- sketches and block scores --------------------------------------------------------------
    # Internally every tensor carries a leading score-head axis H: 1 for heads="mean" (whose state keeps
    # the paper's layout: qs, ks [b, r], a_hat [b, b], walk rows [rows, b]), h_kv for heads="kv" (qs, ks
    # [b, h_kv, r], a_hat [h_kv, b, b], walk rows [h_kv, rows, b]); the pair modes sketch per KV head (qs,
    # ks [b, h_kv, r]) and combine the scores to H = 1 (a_hat [b, b], walk rows [rows, b]). ks has
    # b * sub_blocks rows.
    def _update_sketch(self, ctx: SeqContext, q: torch.Tensor, k_new: torch.Tensor
                       ) -> tuple[int, int, torch.Tensor | None]:
        """Folds the new tokens (q: [n_q, h, d], k: [h_kv, n, d]) into this layer's block sketches and
        recomputes the A_hat rows of the query blocks they touch. Returns (first query block, b, and with
        ``token_query`` the last query block's row of A_hat scored by the last token's query alone, bf16
        [H, 1, b], else None)."""
        B, st, cfg = self.config.block_size, ctx.state, self.config
        parts = cfg.sub_blocks
        q0, n = ctx.q_start, ctx.n
        qb0, nb = q0 // B, -(-n // B)
        dev = q.device
        r = self.srht.sketch_dim
        per_head = cfg.heads != "mean"
        hs = k_new.shape[0] if per_head else 1
        if st.get("paged") and q0 > 0:  # the batched prefill's page-indexed state, in this path's layout
            adopt_prefix(self, ctx, self._cache, self._cache.page_table(ctx.seq_id))
        if q0 == 0:  # a new sequence (or a re-prefill): start this layer's sketches afresh
            shape = (0, hs, r) if per_head else (0, r)
            st.update(qs=torch.zeros(shape, device=dev), ks=torch.zeros(shape, device=dev),
                      a_hat=torch.zeros((hs, 0, 0) if cfg.heads == "kv" else (0, 0), dtype=torch.bfloat16,
                                        device=dev), n=0)
        elif st.get("n") != q0:
            raise NotImplementedError(
                f"sketch_walk: layer {ctx.layer} has sketches of {st.get('n', 0)} tokens but the step starts at "
                f"position {q0}; prefill must start at 0 or continue a sequence this backend has seen")
        grow = nb - st["qs"].shape[0]
        if grow > 0:  # a new block: exact growth, an O(b^2) copy at most once every B tokens
            pad = (0, 0) * (st["qs"].dim() - 1)
            st["qs"], st["ks"] = F.pad(st["qs"], pad + (0, grow)), F.pad(st["ks"], pad + (0, grow * parts))
            st["a_hat"] = F.pad(st["a_hat"], (0, grow, 0, grow))

        n_q = n - q0
        if per_head:  # each KV head's query group averaged; a shard holds whole KV groups, so nothing to reduce
            q_avg = q.float().view(n_q, hs, -1, q.shape[-1]).mean(2)  # [n_q, H, d]
            k_avg = k_new.float().transpose(0, 1)
        else:  # head sums over the heads held here, divided by the model's head counts when shards reduce
            hq = self.model_cfg.num_heads if self.head_reduce is not None else q.shape[1]
            hk = self.model_cfg.num_kv_heads if self.head_reduce is not None else k_new.shape[0]
            q_avg = q.float().sum(1, keepdim=True) / hq
            k_avg = k_new.float().sum(0)[:, None] / hk
        # the token's own query scores the row it ends: at decode, and at the prompt's end, not a chunk's
        want_token = ctx.prompt_end and (n_q == 1 and cfg.token_query != "never" or cfg.token_query == "last")
        # Sum per block (keys: per block part) first, then sketch the few sums (linear): O(b d log d), not
        # O(n d log d). The last token's own query rides along as one more query row, through the same reduce.
        lq = nb - qb0 + int(want_token and n_q > 1)
        pos = torch.arange(q0, n, device=dev)
        sums = torch.zeros(lq + (nb - qb0) * parts, hs, q.shape[-1], device=dev)
        sums.index_add_(0, pos // B - qb0, q_avg)
        sums.index_add_(0, lq + pos // (B // parts) - qb0 * parts, k_avg)
        if lq > nb - qb0:
            sums[lq - 1] = q_avg[-1]
        new = self.srht.apply(sums)  # [lq + (nb - qb0) * parts, H, r]
        if self.head_reduce is not None and not per_head:
            new = self.head_reduce(new)
        qs, ks = st["qs"].view(-1, hs, r), st["ks"].view(-1, hs, r)  # views: in-place writes reach the state
        qs[qb0:nb] += new[: nb - qb0]
        ks[qb0 * parts: nb * parts] += new[lq:]
        st["n"] = n

        # Rows qb0.. of A_hat; rows above qb0 cannot see the key blocks that changed (block causality).
        q_rows = qs[qb0:nb] / block_counts(n, nb, B, dev)[qb0:, None, None]
        if want_token:  # the last row nb - 1 sees every key block, so the token's row needs no mask
            q_rows = torch.cat((q_rows, new[lq - 1: lq]))
        k_cnt = block_counts(n, nb * parts, B // parts, dev)
        want_parts = n_q == 1 and cfg.decode_unit == "part"
        # decode_query="heads": the step's part row scored by each query head's own sketch [H, g, r]
        token_q = (self.srht.apply(q[-1].float()).view(hs, -1, r)
                   if want_parts and cfg.decode_query == "heads" else None)
        rows, part_row = self._scores(q_rows, ks[: nb * parts] / k_cnt.clamp(min=1)[:, None, None], k_cnt > 0,
                                      want_parts, token_q)
        if part_row is not None:  # read (and dropped) by select_decode
            ctx.seq_state["part_row"] = part_row
        causal = torch.arange(nb, device=dev) <= torch.arange(qb0, nb, device=dev)[:, None]
        st["a_hat"].view(-1, nb, nb)[:, qb0:nb] = rows[:, : nb - qb0].masked_fill(~causal, 0.0).to(torch.bfloat16)
        return qb0, nb, rows[:, nb - qb0:].to(torch.bfloat16) if want_token else None

    def _scores(self, q_rows: torch.Tensor, k_parts: torch.Tensor, filled: torch.Tensor, part_row: bool = False,
                token_q: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sketched scores of query rows [R, H, r] against key block parts [b * sub_blocks, H, r] (``filled``:
        parts holding a token): fp32 [H', R, b], a block scoring as its best part; H' = 1 where the heads
        combine (pair, pair-lse: under tensor parallelism one SUM all-reduce of these [R, b] rows). With
        ``part_row`` also the last row's scores per part, the heads combined per part: [H', 1, b * sub_blocks]
        (empty parts -inf; it rides in the same all-reduce), else None. With ``token_q`` [H, g, r] (the last
        row's query heads, ``decode_query="heads"``) that part row is scored by each query head and combined
        over all of them (in the same all-reduce)."""
        s = torch.einsum("ihr,jhr->hij", q_rows, k_parts) / math.sqrt(self.srht.sketch_dim)
        parts = self.config.sub_blocks
        if parts > 1:  # an empty part of the last block is no candidate
            s = s.masked_fill(~filled, -math.inf)
        blocks = s.unflatten(-1, (-1, parts)).amax(-1) if parts > 1 else s
        if not part_row:
            return self._combine_heads(blocks), None
        tok, per_kv = s[:, -1], 1  # the last row's per-part scores, by score head
        if token_q is not None:  # by query head instead: [H * g, b * sub_blocks]
            tok = torch.einsum("hgr,jhr->hgj", token_q, k_parts) / math.sqrt(self.srht.sketch_dim)
            if parts > 1:
                tok = tok.masked_fill(~filled, -math.inf)
            tok, per_kv = tok.flatten(0, 1), tok.shape[1]
        if self.config.heads in ("pair", "pair-lse"):  # both partials in one reduce (elementwise, then summed)
            both = self._finish_heads(torch.cat((self._head_part(blocks).flatten(1), self._head_part(tok, per_kv)), 1))
        else:
            both = torch.cat((blocks.flatten(1), tok), 1)
        nb = blocks.shape[-1]
        return both[:, : -nb * parts].view(-1, *blocks.shape[1:]), both[:, None, -nb * parts:]

    def head_partial(self, s: torch.Tensor) -> torch.Tensor:
        """This shard's part of the paired combine of per-head scores [H, ...] -> [1, ...] fp64: their sum
        (``pair``) or the sum of their exps (``pair-lse``), what ``head_reduce`` sums across shards."""
        x = s.double()
        return (x.exp() if self.config.heads == "pair-lse" else x).sum(0, keepdim=True)

    def _combine_heads(self, s: torch.Tensor, per_kv: int = 1) -> torch.Tensor:
        """Per-head scores [H, ...] -> [H', ...]: ``pair`` their mean, ``pair-lse`` their log-sum-exp over
        every KV head (across shards by ``head_reduce``); ``mean`` and ``kv`` as they are. ``per_kv``: score
        heads per KV head (a group's query heads, KV-head major, with ``decode_query="heads"``). In fp64, one
        device too, so that shards' partial sums, in whatever grouping, round to one device's fp32 values
        (the same selection under tensor parallelism); exp overflows only above scores of ~700."""
        if self.config.heads not in ("pair", "pair-lse"):
            return s
        return self._finish_heads(self._head_part(s, per_kv))

    def _head_part(self, s: torch.Tensor, per_kv: int = 1) -> torch.Tensor:
        """``head_partial``, divided by the head count for ``pair``: what the shards' reduce sums."""
        x = self.head_partial(s)
        if self.config.heads == "pair":
            x = x / (self.model_cfg.num_kv_heads * per_kv if self.head_reduce is not None else s.shape[0])
        return x

    def _finish_heads(self, x: torch.Tensor) -> torch.Tensor:
        """The reduced partial as scores: summed across shards, ``pair-lse``'s log taken; fp32."""
        if self.head_reduce is not None:
            x = self.head_reduce(x)
        if self.config.heads == "pair-lse":  # a part empty on every head stays at the floor, below any real score
            x = x.clamp(min=torch.finfo(torch.float64).tiny).log()
        return x.float()

    # ---- the choice of blocks and parts ---------------------------------------------------------
    def _choose(self, scores: torch.Tensor, qb0: int, nb: int, decode: bool = False) -> tuple[torch.Tensor, int]:
        """Per score head and query block qb0..nb-1: forced sink + local blocks plus the top blocks by
        ``scores`` [H, rows, nb] up to the row budget (``prefill_block_budget``'s, or in ``decode`` the one row's
        ``row_budget`` of its blocks). Returns the boolean mask [H, rows, nb] and the widest row (host int, no
        device sync)."""
        rows_cpu = torch.arange(qb0, nb)
        local = self.config.local_blocks
        d = self.layer_density
        budget = (row_budget(d, rows_cpu + 1) if decode
                  else prefill_block_budget(d, rows_cpu, nb - 1, local + 1, self.config.block_size))
        forced_n = torch.minimum(rows_cpu + 1, torch.tensor(local + 1))  # block 0 may also be a local one
        extra = (budget - forced_n).clamp(min=0)
        width = int(torch.maximum(budget, forced_n).max())  # a CPU tensor: no device sync
        dev = scores.device
        qblk = torch.arange(qb0, nb, device=dev)[:, None]
        cols = torch.arange(nb, device=dev)
        allowed = cols <= qblk
        forced = (cols == 0) | ((cols > qblk - local) & allowed)
        # One row (decode): an int budget keeps topk_mask free of host syncs. Several rows (prefill): a
        # per-row tensor, for which topk_mask does one .item() to size its sort.
        k: int | torch.Tensor = int(extra[0]) if nb - qb0 == 1 else extra.to(dev)
        return topk_mask(scores, k, allowed.expand_as(scores), forced.expand_as(scores)), width

    def _choose_parts(self, scores: torch.Tensor, n: int, h_kv: int) -> TokenSelection:
        """Decode at part granularity: the parts (B / sub_blocks tokens) of the sink and local blocks plus the
        top parts by ``scores`` [H', 1, b * sub_blocks], up to the row's budget of tau * sub_blocks parts."""
        cfg = self.config
        parts, size = cfg.sub_blocks, cfg.block_size // cfg.sub_blocks
        nb, held = -(-n // cfg.block_size), -(-n // size)
        budget = host_row_budget(self.layer_density, nb) * parts
        forced_blocks = {0, *range(max(0, nb - cfg.local_blocks), nb)}
        forced_n = sum(min(parts, held - j * parts) for j in forced_blocks)  # host ints: no device sync
        dev = scores.device
        cols = torch.arange(nb * parts, device=dev)
        allowed = cols < held
        blk = cols // parts
        forced = ((blk == 0) | (blk >= nb - cfg.local_blocks)) & allowed
        mask = topk_mask(scores, max(0, budget - forced_n), allowed.expand_as(scores), forced.expand_as(scores))
        idx = indices_from_mask(mask, max(budget, forced_n))
        return TokenSelection(idx[:, 0].expand(h_kv, -1), size)

    # ---- SparseMethod's per-sequence seams ------------------------------------------------------
    def select_prefill(self, ctx: SeqContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> BlockSelection:
        cache = self._cache
        if cache is None or cache.page_size != self.config.block_size:
            return self._prefill_rows(ctx, q, k[:, ctx.q_start: ctx.n])
        return self._prefill_rows(ctx, q, k[:, ctx.q_start: ctx.n], cache, cache.page_table(ctx.seq_id))

    def _prefill_rows(self, ctx: SeqContext, q: torch.Tensor, k_new: torch.Tensor, cache: KVCache | None = None,
                      pages: torch.Tensor | None = None) -> BlockSelection:
        """One sequence's prefill selection from its new queries and keys alone (k_new [h_kv, n_q, d]): the
        sketches hold every earlier token, so nothing of the context is read. With the sequence's cache pages,
        its blocks' sums are also kept per page, and a prompt that starts from a cached prefix rebuilds its
        state from them first (the prefix cache)."""
        if pages is not None and ctx.q_start > 0 and ("n" not in ctx.state or ctx.state.get("paged")):
            adopt_prefix(self, ctx, cache, pages)
        qb0, nb, token_row = self._update_sketch(ctx, q, k_new)
        if pages is not None:
            store_prefix(self, ctx, cache, pages, qb0, nb)
        mask, width = self._choose(walk_rows(self, ctx, qb0, nb, token_row), qb0, nb)
        idx = indices_from_mask(mask, width)  # [H, nqb, width]
        return BlockSelection(idx.expand(k_new.shape[0], -1, -1), self.config.block_size)

    def prefill_select_per_sequence(self, layer: int, q: torch.Tensor, view: PrefillView) -> PackedBlockSelection:
        """Each sequence's ``_prefill_rows`` from the step's packed new keys (its state is per sequence: block
        sketches, A_hat rows and the walk), packed for the batch's one varlen attend: the path of the modes the
        batched selection does not serve, and its test oracle."""
        k_new, cu = view.new_keys(), view.batch.cu_q
        return view.pack([self._prefill_rows(view.context(i, self._seq_state), q[cu[i]: cu[i + 1]],
                                             k_new[cu[i]: cu[i + 1]].transpose(0, 1), view.cache,
                                             view.batch.page_tables[i])
                          for i in range(len(view.batch.seq_ids))])

    def select_decode(self, ctx: SeqContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> TokenSelection:
        qb0, nb, token_row = self._update_sketch(ctx, q.unsqueeze(0), k[:, ctx.n - 1: ctx.n])  # the new token's block
        if self.config.decode_unit == "part":
            return self._choose_parts(ctx.seq_state.pop("part_row"), ctx.n, k.shape[0])
        mask, width = self._choose(walk_rows(self, ctx, qb0, nb, token_row), qb0, nb, decode=True)
        idx = indices_from_mask(mask, width)  # [H, 1, width] block indices
        return TokenSelection(idx[:, 0].expand(k.shape[0], -1), self.config.block_size)

