"""Sketch&Walk (papers/sketch-and-walk.md, SPEC section 1): block selection from sketched block scores
walked across layers, for prefill (Algorithm 1) and decode (Algorithm 2). Plain PyTorch reference.

Per sparse layer k and sequence: Q_avg / K_avg (head means) are reduced to block means, sketched with a
fixed SRHT H_d (d x r), A_hat = Q~ K~^T / sqrt(r) under the block-causal mask, W^k = row-softmax(A_hat)**s,
R^k = R^{k-1} W^k (R^0 = W at the first sparse layer), and each query block attends the top key blocks
of its row of R^k plus the sink and diagonal blocks, on the original per-head Q, K, V.

Defaults (measured, BENCHMARKS.md "Sketch&Walk: head pairing and finer decode selection"): walk one-hop,
token_query last, heads pair-lse, sub_blocks 8, decode_unit part; SPEC's form is walk="product",
token_query="never" with ``GRAPH_DECODE`` (heads="mean", sub_blocks=1, decode_unit="block"). At density 0.2
on the default model they retrieve 0.47 against 0.17 for SPEC's head mean over whole blocks (dense 0.64).
The batched decode seam (``decode_select``, captured in CUDA graphs): its state and selection are in
``sketch_walk_rows`` for ``GRAPH_DECODE``'s scoring and ``sketch_walk_parts`` for the paired modes
(``RuntimeConfig.sw_graph_paired`` False decodes them per sequence).

The batched prefill seam (``prefill_select``): for one-hop with per-KV-head sketches (the default; heads
pair-lse, pair or kv) ``sketch_walk_batch`` selects the whole step in launches that do not grow with the
batch, from block sums kept per page (a sequence's metadata then holds only ``n``; per-sequence readers
rebuild the dict layout from its pages, ``sketch_walk_prefix.adopt_prefix``). The walks that chain layers
(rollout, product) and SPEC's head mean select per sequence (``prefill_select_per_sequence``, also the
batched path's test oracle).

The choices where SPEC and the paper are silent, with the measurements behind each, and the state layout of
every mode are in docs/sketch_walk.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from raysparse.attention import ShardContext
from raysparse.config import ModelConfig
from raysparse.kernels.formats import PackedBlockSelection
from raysparse.kv_cache import KVCache
from raysparse.methods.base import (
    DecodeView,
    PrefillView,
    SeqContext,
    SparseMethod,
    host_row_budget,
    method_spec,
    prefill_block_budget,
    row_budget,
)
from raysparse.methods.hadamard import SRHT, derive_seed
from raysparse.methods.registry import register
from raysparse.methods.selection import BlockSelection, TokenSelection, indices_from_mask, topk_mask
from raysparse.methods.sketch_walk_batch import batched_mode, prefill_select_batched
from raysparse.methods.sketch_walk_config import (
    DECODE_UNITS,
    GRAPH_DECODE,
    HEADS,
    TOKEN_QUERIES,
    WALKS,
    SketchWalkConfig,
)
from raysparse.methods.sketch_walk_prefix import adopt_prefix, store_prefix
from raysparse.runtime_config import RuntimeConfig

# the config's names stay importable from here, where the method's users look for them
__all__ = ["DECODE_UNITS", "GRAPH_DECODE", "HEADS", "TOKEN_QUERIES", "WALKS", "SketchWalk", "SketchWalkConfig",
           "block_counts", "renormalise", "rollout_step", "walk_weights"]

log = logging.getLogger(__name__)


def block_counts(n: int, num_blocks: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Tokens in each of the first ``num_blocks`` blocks of an n-token sequence (the last may be partial)."""
    return (n - torch.arange(num_blocks, device=device) * block_size).clamp(max=block_size).float()


def walk_weights(a_hat: torch.Tensor, exponent: float, stochastic: bool = False) -> torch.Tensor:
    """W = row-softmax(A_hat over causal blocks) ** s, fp32 [..., b, b], zero above the block diagonal.
    ``stochastic``: rows rescaled to sum 1, i.e. W = row-softmax(s * A_hat) (same ranking in each row)."""
    b = a_hat.shape[-1]
    causal = torch.ones(b, b, dtype=torch.bool, device=a_hat.device).tril()
    logits = a_hat.float().masked_fill(~causal, float("-inf"))
    if stochastic:
        return torch.softmax(exponent * logits, dim=-1)
    return torch.exp(exponent * torch.log_softmax(logits, dim=-1))


def rollout_step(a_hat: torch.Tensor, exponent: float, residual: float) -> torch.Tensor:
    """One rollout transition: alpha I + (1 - alpha) row-softmax(s * A_hat), fp32 [..., b, b], rows sum to 1."""
    w = walk_weights(a_hat, exponent, stochastic=True) * (1.0 - residual)
    return w + residual * torch.eye(w.shape[-1], device=w.device)


def renormalise(rows: torch.Tensor) -> torch.Tensor:
    """Rows scaled to sum 1 (ranking unchanged); keeps the product of many W's out of underflow."""
    return rows / rows.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)


class SketchWalk(SparseMethod):
    name = "sketch_walk"
    config_cls = SketchWalkConfig
    config: SketchWalkConfig

    def __init__(self, model_cfg: ModelConfig, config: SketchWalkConfig | None = None) -> None:
        super().__init__(model_cfg, config)
        cfg = self.config
        self.srht = SRHT(model_cfg.head_dim, cfg.sketch_dim, derive_seed(cfg.seed, model_cfg.head_dim))
        sparse = [layer for layer in range(model_cfg.num_layers) if not self.is_dense_layer(layer)]
        self.first_sparse: int | None = sparse[0] if sparse else None
        # Tensor parallelism: a SUM all-reduce over the shards (docs/sketch_walk.md); None on one device.
        self.head_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def bind(self, shard: ShardContext) -> None:
        """Under tensor parallelism the walk coordinator: the block sums are SUM-all-reduced every layer, so
        every shard holds identical sketches, walk state and selections. With the shard's cache, the batched
        decode's fixed-shape state (``build_batched``)."""
        if shard.all_reduce is not None:
            self.head_reduce = shard.all_reduce
        if shard.cache is not None:
            self._cache = shard.cache  # the reference prefill keeps its per-page sums there too (prefix cache)
            self.build_batched(shard.cache, shard.max_batch, runtime=shard.runtime,
                               max_positions=self.model_cfg.max_position_embeddings)

    # ---- the batched seam -----------------------------------------------------------------------
    # Two state layouts (docs/sketch_walk.md): the paired scorings keep key part sums per KV page
    # (``sketch_walk_parts``, shared by every instance with the same sketch); SPEC's head mean keeps a slot of
    # sums and walk rows per running sequence (``sketch_walk_rows``: row state, placed by ``graph_prepare``).
    batch_decoder: Any = None
    _cache: KVCache | None = None

    def build_batched(self, cache: KVCache, max_batch: int | None, runtime: RuntimeConfig | None = None,
                      state_budget_bytes: int = 8 << 30, max_positions: int | None = None) -> bool:
        """Allocates the batched decode's state over ``cache``; returns whether this instance now decodes on the
        batched seam. It does not where its state would exceed ``state_budget_bytes`` or the device has no room
        left (the log says so; the per-sequence decode then runs, much slower), where a page is not a block,
        and for a head-mean instance without a graph runner (``max_batch`` None: its slots are sized by it)."""
        from raysparse.methods.sketch_walk_parts import PartsDecode
        from raysparse.methods.sketch_walk_rows import RowsDecode

        self.batch_decoder = None
        runtime = runtime or RuntimeConfig()
        if cache.page_size != self.config.block_size:
            return False
        if self.config.heads != "mean":
            if not runtime.sw_graph_paired or not PartsDecode.supports(self.config):
                return False
            shared = PartsDecode.state_key(self) in cache.shared_state  # no new allocation
            need = 0 if shared else PartsDecode.state_bytes(self, cache.num_pages, cache.num_kv_heads)
            return self._build(lambda: PartsDecode(self, cache, runtime), need, state_budget_bytes)
        if max_batch is None or self.config.sub_blocks > 1:  # the head-mean rows score whole blocks
            return False
        limit = cache.num_pages if max_positions is None else min(cache.num_pages, -(-max_positions // cache.page_size))
        need = (max_batch + 1) * RowsDecode.state_bytes(self, limit)
        return self._build(lambda: RowsDecode(self, cache, max_batch, limit, runtime), need, state_budget_bytes)

    def _build(self, make: Callable[[], Any], need: int, budget: int) -> bool:
        # The state is allocated when a method is first used, after the KV cache took its memory: where the
        # device has no room left, the method decodes per sequence rather than failing the request that asked.
        if need > budget:
            log.warning("sketch_walk: the batched decode's state (%.2f GB) exceeds its budget (%.2f GB): decoding "
                        "per sequence, much slower", need / 2**30, budget / 2**30)
            return False
        try:
            self.batch_decoder = make()
        except torch.OutOfMemoryError:
            log.warning("sketch_walk: no device memory left for the batched decode's state (%.2f GB): decoding per "
                        "sequence, much slower; a smaller KV cache (--kv-cache-tokens) leaves room for it",
                        need / 2**30)
            return False
        return True

    @property
    def batched_decode(self) -> bool:  # type: ignore[override]
        return self.batch_decoder is not None

    @property
    def row_state(self) -> bool:  # type: ignore[override]
        return self.config.heads == "mean"

    @property
    def decode_unit(self) -> int:  # type: ignore[override]
        cfg = self.config
        return cfg.block_size // cfg.sub_blocks if cfg.decode_unit == "part" else cfg.block_size

    def graph_prepare(self, rows: list[int], cache: KVCache) -> None:
        """A sequence's prefill state moves into the batched decode's (its pages' part sums, or a slot) on its
        first decode step; the per-sequence state is dropped then."""
        if self.batch_decoder is not None:
            self.batch_decoder.prepare(rows, cache)

    def decode_select(self, layer: int, q: torch.Tensor, view: DecodeView) -> torch.Tensor:
        """One list per row, the same for every KV head (the heads are combined or averaged before the top-k);
        the step's new key enters the sums inside this call, in the scoring launch, so ``update_state`` has
        nothing to do."""
        idx, unit = self.batch_decoder.layer_select(layer, q, view.cache, view.batch, view.kv.page_table,
                                              view.kv.seqlens)
        assert unit == self.decode_unit
        return idx[:, None, :].expand(-1, view.cache.num_kv_heads, -1)  # the kernel reads the heads' stride 0

    def decode_keys(self, layer: int, n: int) -> int:
        return self.batch_decoder.row_keys(n)

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        if self.batch_decoder is not None:
            self.batch_decoder.release(seq_id)

    # ---- sketches and block scores --------------------------------------------------------------
    # Internally every tensor carries a leading score-head axis H: 1 for heads="mean" (whose state keeps
    # SPEC's layout: qs, ks [b, r], a_hat [b, b], walk rows [rows, b]), h_kv for heads="kv" (qs, ks
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
        rows, part_row = self._scores(q_rows, ks[: nb * parts] / k_cnt.clamp(min=1)[:, None, None], k_cnt > 0,
                                      n_q == 1 and cfg.decode_unit == "part")
        if part_row is not None:  # read (and dropped) by select_decode
            ctx.seq_state["part_row"] = part_row
        causal = torch.arange(nb, device=dev) <= torch.arange(qb0, nb, device=dev)[:, None]
        st["a_hat"].view(-1, nb, nb)[:, qb0:nb] = rows[:, : nb - qb0].masked_fill(~causal, 0.0).to(torch.bfloat16)
        return qb0, nb, rows[:, nb - qb0:].to(torch.bfloat16) if want_token else None

    def _scores(self, q_rows: torch.Tensor, k_parts: torch.Tensor, filled: torch.Tensor, part_row: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sketched scores of query rows [R, H, r] against key block parts [b * sub_blocks, H, r] (``filled``:
        parts holding a token): fp32 [H', R, b], a block scoring as its best part; H' = 1 where the heads
        combine (pair, pair-lse: under tensor parallelism one SUM all-reduce of these [R, b] rows). With
        ``part_row`` also the last row's scores per part, the heads combined per part: [H', 1, b * sub_blocks]
        (empty parts -inf; it rides in the same all-reduce), else None."""
        s = torch.einsum("ihr,jhr->hij", q_rows, k_parts) / math.sqrt(self.srht.sketch_dim)
        parts = self.config.sub_blocks
        if parts > 1:  # an empty part of the last block is no candidate
            s = s.masked_fill(~filled, -math.inf)
        blocks = s.unflatten(-1, (-1, parts)).amax(-1) if parts > 1 else s
        if not part_row:
            return self._combine_heads(blocks), None
        both = self._combine_heads(torch.cat((blocks.flatten(1), s[:, -1]), 1))
        nb = blocks.shape[-1]
        return both[:, : -nb * parts].view(-1, *blocks.shape[1:]), both[:, None, -nb * parts:]

    def head_partial(self, s: torch.Tensor) -> torch.Tensor:
        """This shard's part of the paired combine of per-head scores [H, ...] -> [1, ...] fp64: their sum
        (``pair``) or the sum of their exps (``pair-lse``), what ``head_reduce`` sums across shards."""
        x = s.double()
        return (x.exp() if self.config.heads == "pair-lse" else x).sum(0, keepdim=True)

    def _combine_heads(self, s: torch.Tensor) -> torch.Tensor:
        """Per-head scores [H, ...] -> [H', ...]: ``pair`` their mean, ``pair-lse`` their log-sum-exp over
        every KV head (across shards by ``head_reduce``); ``mean`` and ``kv`` as they are. In fp64, one
        device too, so that shards' partial sums, in whatever grouping, round to one device's fp32 values
        (the same selection under tensor parallelism); exp overflows only above scores of ~700."""
        heads, reduce = self.config.heads, self.head_reduce
        if heads not in ("pair", "pair-lse"):
            return s
        x = self.head_partial(s)
        if heads == "pair":
            x = x / (self.model_cfg.num_kv_heads if reduce is not None else s.shape[0])
        if reduce is not None:
            x = reduce(x)
        if heads == "pair-lse":  # a part empty on every head stays at the floor, below any real score
            x = x.clamp(min=torch.finfo(torch.float64).tiny).log()
        return x.float()

    # ---- the walk -------------------------------------------------------------------------------
    def _walk(self, ctx: SeqContext, qb0: int, nb: int, token_row: torch.Tensor | None = None) -> torch.Tensor:
        """Rows qb0..nb-1 of R^k for this layer (fp32 [H, nb - qb0, nb]), carried in ``ctx.seq_state``.
        ``token_row`` replaces the last row of A_hat for this call only: the state keeps the block mean's row,
        which the rows of later query blocks walk through."""
        cfg = self.config
        a_hat = ctx.state["a_hat"].view(-1, nb, nb)
        if token_row is not None:
            a_hat = torch.cat((a_hat[:, : nb - 1], token_row), 1)
        if cfg.walk == "rollout":
            w = rollout_step(a_hat, cfg.exponent, cfg.residual)
        else:
            w = walk_weights(a_hat, cfg.exponent)
        step = (ctx.q_start, ctx.n)
        if ctx.layer == self.first_sparse or cfg.walk == "one-hop":
            rows = w[:, qb0:nb]
        else:
            prev = ctx.seq_state.get("walk")
            if prev is None or prev[0] != step:
                raise RuntimeError(f"sketch_walk: layer {ctx.layer} found no walk state from an earlier sparse "
                                   f"layer of this step; layers must run in order from layer {self.first_sparse}")
            rows = prev[1].view(w.shape[0], nb - qb0, nb) @ w
        rows = renormalise(rows)
        ctx.seq_state["walk"] = (step, rows if cfg.heads == "kv" else rows[0])
        return rows

    @property
    def prefill_forced_blocks(self) -> int:  # type: ignore[override]
        return self.config.local_blocks + 1  # the sink block and the local ones (the diagonal included)

    def decode_forced_keys(self, n: int) -> int:
        B = self.config.block_size
        nb = -(-n // B)
        return sum(min(B, n - j * B) for j in {0, *range(max(0, nb - self.config.local_blocks), nb)})

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

    # ---- SparseMethod ---------------------------------------------------------------------------
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
        mask, width = self._choose(self._walk(ctx, qb0, nb, token_row), qb0, nb)
        idx = indices_from_mask(mask, width)  # [H, nqb, width]
        return BlockSelection(idx.expand(k_new.shape[0], -1, -1), self.config.block_size)

    # Tests set it to run the per-sequence reference where the batched selection would serve.
    prefill_reference = False

    def prefill_select(self, layer: int, q: torch.Tensor, view: PrefillView) -> PackedBlockSelection:
        """The batch's selection: ``sketch_walk_batch`` (launches that do not grow with the batch) for the modes
        it serves (one-hop, per-KV-head sketches: the default), else per sequence."""
        if batched_mode(self.config) and not self.prefill_reference:
            return prefill_select_batched(self, layer, q, view)
        return self.prefill_select_per_sequence(layer, q, view)

    def prefill_select_per_sequence(self, layer: int, q: torch.Tensor, view: PrefillView) -> PackedBlockSelection:
        """Each sequence's ``_prefill_rows`` from the step's packed new keys (its state is per sequence: block
        sketches, A_hat rows and the walk), packed for the batch's one varlen attend: the path of the modes the
        batched selection does not serve, and its test oracle."""
        k_new, cu = view.new_keys(), view.batch.cu_q
        return view.pack([self._prefill_rows(view.context(i, self._seq_state), q[cu[i]: cu[i + 1]],
                                             k_new[cu[i]: cu[i + 1]].transpose(0, 1), view.cache,
                                             view.batch.page_tables[i])
                          for i in range(len(view.batch.seq_ids))])

    # Prefix caching: rebuilt, from per-page sums every prefill keeps (``sketch_walk_prefix``).
    prefix_state = "rebuilt"

    def select_decode(self, ctx: SeqContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> TokenSelection:
        qb0, nb, token_row = self._update_sketch(ctx, q.unsqueeze(0), k[:, ctx.n - 1: ctx.n])  # the new token's block
        if self.config.decode_unit == "part":
            return self._choose_parts(ctx.seq_state.pop("part_row"), ctx.n, k.shape[0])
        mask, width = self._choose(self._walk(ctx, qb0, nb, token_row), qb0, nb, decode=True)
        idx = indices_from_mask(mask, width)  # [H, 1, width] block indices
        return TokenSelection(idx[:, 0].expand(k.shape[0], -1), self.config.block_size)

    def state_bytes(self, n: int) -> dict[str, int]:
        """Bytes of Sketch&Walk state per sequence of n tokens (all sparse layers), for capacity planning."""
        b = -(-n // self.config.block_size)
        layers = len(self.sparse_layers())
        h_kv, cfg = self.model_cfg.num_kv_heads, self.config
        hs = h_kv if cfg.heads == "kv" else 1  # score heads: walks and A_hat
        sums = (1 + cfg.sub_blocks) * (1 if cfg.heads == "mean" else h_kv)  # qs rows + ks rows per block
        return {"a_hat": 2 * b * b * layers * hs, "sketch_sums": 4 * self.srht.sketch_dim * b * layers * sums,
                "decode_walk_row": 4 * b * hs}


register(method_spec(SketchWalk, "Sketch&Walk: SRHT-sketched block scores walked across layers (prefill + decode)"))
