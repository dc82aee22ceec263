"""SOCKET: soft-LSH token selection for decode (docs/methods/socket.md). The per-sequence reference
(``select_decode``) and the batched decode step over per-page hash ids (``decode_select``), in one class.

Prefill runs dense attention (SOCKET is a decode method) and builds, per sparse layer and KV head, the
hash index of the keys: L tables of P seeded Gaussian hyperplanes W_l (P x d), one bucket id per key and
table (sign pattern of W_l k, see ``lsh``), stored as uint8 when P <= 8 (int16 up to P = 15), plus the
value norms ||v_j||_2. Decode hashes only the keys appended since the last call, then scores every key
from its bucket ids and value norm alone (never the keys):

    u_l = tanh(W_l q) / sqrt(d),  p_l(r) = softmax_r(u_l . c_r / tau) over the 2**P corners c_r,
    Score(j) = ||v_j||_2 * sum_l p_l(bucket_l(j)),

and attends exactly over the union of the sink tokens, the local window and the top-k scored tokens
outside both (disjoint by construction, so deduplicated), ascending, shared by the group's query heads.

Choices the published method leaves open:
- Budget. ``density`` (default 0.1) is the fraction of the context attended in total, forced tokens
  included (round(density * n), as ``row_budget``): k = budget - sink - local, so methods compare at equal
  real density. Sink and local take at most ``forced_share`` (default 0.25) of the budget: where they would
  take more (short contexts, or a whole-model density the dense layers leave little of), they shrink to that
  share in proportion to their sizes, and the rest of the budget is scored. The published 128 + 128 are kept
  whole wherever the budget reaches 1024 keys (10% of 10240 keys with every layer sparse). With
  ``forced_share=1`` they shrink only to the whole budget, and where they take all of it no token is scored
  (how each share measured: docs/methods/socket.md). The attended fraction is the budget (rounded per row)
  either way. An explicit ``top_k`` is the paper's k: that many scored tokens on top of sink and local.
  k is clamped to the tokens outside sink and local, so ``top_k >= n`` (or density 1.0) attends every key:
  dense.
- Sink = the first min(sink_tokens, n) keys; local = the last ones (the new token included) up to
  local_tokens, never overlapping the sinks.
- GQA (``group_reduce``, default "mean"): p_l is averaged over the group's query heads per table and
  bucket. The scorer is linear in p, so "mean" scores each key by the mean of the g heads' own SOCKET
  scores: the soft-count estimate of the group's summed attention mass, the quantity the oracle baseline
  ranks by. "max" (sum_l max_g p_l) instead favours keys one head wants strongly; it upper-bounds every
  head's score but is not a sum of kernel estimates.
- Hard LSH ablation (``socket_hard`` / ``hard=True``): the paper's hard-collision baseline, the number of
  tables in which the key's bucket equals the query's hard bucket sign(W_l q), NOT weighted by ||v|| (the
  baseline has no value term). It runs as a one-hot p_l through the same scorer and group reduction (mean:
  collisions averaged over the group's heads; max: tables where any head collides). Same budget rule.
- Value-norm factor (``value_norm``): the published scorer multiplies the soft count by ||v_j||. On the default
  model it loses (docs/methods/socket.md), so the default leaves it out (``value_norm=True`` restores it): the
  soft count estimates an angular kernel, far flatter than exp(q.k / sqrt d), so multiplying it by ||v|| (which
  varies 5-8x across keys there) lets the value norm dominate the ranking. Without the factor the scorer is the
  published soft count, with tau 0.3 and the group mean.
- Ties (frequent for hard counts) break toward the lower token index (a stable sort), deterministically.
- Probabilities' storage (``probs``): the batched decode computes the bucket distributions in fp32 and stores them
  for the scorer in fp32 (default) or fp16. The scorer's gathers of random buckets bound it on GPUs, and fp16
  halves the cache lines they touch (19% faster at 64 rows of 7168 keys on an H200, record
  ``socket_kernels_gpu_h200_2026-12-04``) at a relative error of about 1.6e-4 in the scores, which can reorder
  near-ties against the per-sequence reference (fp32).
- Hyperplanes are drawn on the CPU from a generator seeded by (seed, layer, global KV head), fixed for
  the backend's life and identical on every device, each rounded to a bf16 value (``lsh.hyperplanes``: bf16
  keys then hash in one exact bf16 tensor-core product). With tensor parallelism set ``kv_head_offset`` to
  the shard's first KV head so each head keeps its tables.
- Metadata: ``metadata_bytes_per_token`` = per sparse layer and KV head L bytes of bucket ids (2 L for
  P > 8), + 4 bytes of fp32 value norm only where the scorer uses it (``value_norm=True``, soft counts): the
  default and ``socket_hard`` neither compute nor store norms. Dense layers store nothing. The per-sequence
  arrays grow by 1/8 when full (amortised O(1) per appended key), so allocated memory is at most ~12.5% above that.
- Prefix caching (``prefix_state = "pages"``): the batched decode's bucket ids and value norms are kept per
  physical page (``Socket.page_pools``), so a prompt starting from cached pages finds its prefix's
  hashed already.
- Chunked prefill: each chunk attends densely and hashes the keys not hashed yet. Rollback of rejected
  speculative tokens needs no hook: every call rehashes its own new keys (positions q_start..n-1).

Host syncs: none in decode (budgets and widths come from the host-side length n; the metered count is
the known width). The reference gathers K/V per step; the Triton path replaces that on GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from raysparse.attention import causal_pairs, dense_attention
from raysparse.config import ModelConfig
from raysparse.kernels.dispatch import (
    collision_bias,
    forced_tokens,
    lsh_bucket_ids_into_slots,
    lsh_bucket_probs,
    paged_collision_scores,
    select_list,
)
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods import lsh
from raysparse.methods.base import MethodConfig, SparseMethod
from raysparse.methods.budget import host_row_budget, row_budget
from raysparse.methods.registry import method_spec, register
from raysparse.methods.selection import TokenSelection
from raysparse.methods.views import DecodeView, SeqContext

GROUP_REDUCES = ("mean", "max")
PROB_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
NORM_BYTES = 4  # fp32 ||v||_2 per key and KV head


@dataclass(frozen=True)
class SocketConfig(MethodConfig):
    density: float = 0.1  # total attended fraction of the context (sink + local included)
    top_k: int | None = None  # explicit k scored tokens beyond sink + local (overrides density)
    planes: int = 8  # P hyperplanes per table: R = 2**P buckets
    tables: int = 60  # L
    tau: float = 0.3
    sink_tokens: int = 128
    local_tokens: int = 128
    forced_share: float = 0.25  # with a density: the most of the budget sink + local take (module docstring)
    group_reduce: str = "mean"
    hard: bool = False
    value_norm: bool = False  # the published ||v_j|| factor on the soft score: off by measurement (module docstring)
    probs: str = "fp32"  # the batched decode's bucket distributions as stored for the scorer: fp32 or fp16
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        lsh.bucket_dtype(self.planes)  # validates P
        if self.tables < 1:
            raise ValueError(f"tables must be >= 1, got {self.tables}")
        if not self.tau > 0:
            raise ValueError(f"tau must be positive, got {self.tau}")
        if self.sink_tokens < 0 or self.local_tokens < 0:
            raise ValueError(f"sink_tokens and local_tokens must be >= 0, got {self.sink_tokens}, {self.local_tokens}")
        if not 0 < self.forced_share <= 1:
            raise ValueError(f"forced_share must be in (0, 1], got {self.forced_share}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or self.top_k < 0):
            raise ValueError(f"top_k must be a non-negative count or None, got {self.top_k!r}")
        if self.probs not in PROB_DTYPES:
            raise ValueError(f"probs must be one of {tuple(PROB_DTYPES)}, got {self.probs!r}")
        if self.group_reduce not in GROUP_REDUCES:
            raise ValueError(f"group_reduce must be one of {GROUP_REDUCES}, got {self.group_reduce!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be a non-negative 64-bit integer, got {self.seed!r}")


@dataclass(frozen=True)
class SocketHardConfig(SocketConfig):
    hard: bool = True


@dataclass(frozen=True)
class SocketStep:
    """What every sparse layer of a batched decode step reads (``Socket.plan_layers``)."""

    sink: torch.Tensor  # [B] forced sink tokens per row
    local: torch.Tensor  # [B] forced local window per row
    top: torch.Tensor  # [B h_kv] scored tokens per (row, KV head)
    bias: torch.Tensor | None  # off Triton: the forced (+inf) and past-the-length (-inf) tokens' score bias


class Socket(SparseMethod):
    name = "socket"
    config_cls = SocketConfig
    config: SocketConfig

    def __init__(self, model_cfg: ModelConfig, config: SocketConfig | None = None) -> None:
        super().__init__(model_cfg, config)
        self.kv_head_offset = 0  # first global KV head of this shard (tensor parallelism)
        self._planes: dict[tuple, torch.Tensor] = {}

    # ---- hash index -------------------------------------------------------------------------------
    def planes_for(self, layer: int, h_kv: int, device: torch.device) -> torch.Tensor:
        """The fixed hyperplanes of ``layer``'s KV heads: fp32 ``[h_kv, L, P, d]`` on ``device``."""
        key = (layer, h_kv, self.kv_head_offset, device)
        if key not in self._planes:
            c = self.config
            heads = range(self.kv_head_offset, self.kv_head_offset + h_kv)
            self._planes[key] = lsh.hyperplanes(c.seed, layer, heads, c.tables, c.planes,
                                                self.model_cfg.head_dim).to(device)
        return self._planes[key]

    def update_index(self, ctx: SeqContext, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bucket ids ``[h_kv, L, n]`` and value norms ``[h_kv, n]`` of the n cached keys, kept in ctx.state.
        Hashes only the keys not hashed yet, and always the call's own keys from ``q_start`` on: after a
        rollback (``KVCache.truncate``) those slots hold new keys, so stale ids past it are overwritten."""
        st, n = ctx.state, ctx.n
        done = min(st.get("socket_n", 0), ctx.q_start, n) if "socket_buckets" in st else 0
        if n > done:
            w = self.planes_for(ctx.layer, k.shape[0], k.device)
            ids = lsh.bucket_ids(w, k[:, done:n]).to(lsh.bucket_dtype(self.config.planes))
            norms = torch.linalg.vector_norm(v[:, done:n].float(), dim=-1)
            if done == 0:
                st["socket_buckets"], st["socket_vnorm"] = ids, norms
            else:
                cap = st["socket_vnorm"].shape[1]
                if cap < n:  # grow by 1/8 (at least 64 keys): amortised O(1) copies per key
                    extra = max(n - cap, cap // 8, 64)
                    b, vn = st["socket_buckets"], st["socket_vnorm"]
                    st["socket_buckets"] = torch.cat([b, b.new_zeros(*b.shape[:2], extra)], 2)
                    st["socket_vnorm"] = torch.cat([vn, vn.new_zeros(vn.shape[0], extra)], 1)
                st["socket_buckets"][:, :, done:n] = ids
                st["socket_vnorm"][:, done:n] = norms
            st["socket_n"] = n
        return st["socket_buckets"][:, :, :n], st["socket_vnorm"][:, :n]

    # ---- scoring and selection ----------------------------------------------------------------------
    def bucket_probs(self, layer: int, q: torch.Tensor, h_kv: int) -> torch.Tensor:
        """q: [h, d] -> the group-reduced per-table bucket distribution ``[h_kv, L, R]`` (one-hot if hard)."""
        w = self.planes_for(layer, h_kv, q.device)
        qg = q.view(h_kv, -1, q.shape[-1])
        p = lsh.hard_bucket_probs(w, qg) if self.config.hard else lsh.soft_bucket_probs(w, qg, self.config.tau)
        return p.mean(1) if self.config.group_reduce == "mean" else p.amax(1)

    def scores(self, ctx: SeqContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Score of every cached key per KV head: fp32 ``[h_kv, n]``. Reads K/V only to hash new keys."""
        buckets, norms = self.update_index(ctx, k, v)
        s = lsh.collision_scores(self.bucket_probs(ctx.layer, q, k.shape[0]), buckets)
        return s if self.config.hard or not self.config.value_norm else s * norms

    def has_density_budget(self) -> bool:
        return self.config.top_k is None  # an explicit k replaces the density

    def decode_forced_keys(self, n: int) -> int | None:
        if self.config.top_k is not None:  # an explicit k: no density budget
            return None
        sink, local, _ = self.budget(n)
        return sink + local

    def budget(self, n: int) -> tuple[int, int, int]:
        """(sink, local, k) token counts for a context of n keys (host ints: no device sync)."""
        c = self.config
        sink = min(c.sink_tokens, n)
        local = min(c.local_tokens, n - sink)
        if c.top_k is not None:
            k = c.top_k
        else:
            b = host_row_budget(self.layer_density, n)  # host ints: the meter calls this per step
            cap = math.floor(b * c.forced_share)  # a float64 product, as the device rule's (budget_rows)
            if cap < sink + local:  # the forced tokens would take more: they shrink to their share, in proportion
                sink = min(sink, cap * c.sink_tokens // max(1, c.sink_tokens + c.local_tokens))
                # from the shrunk sink: a short context's window may then take what the sink left
                local = min(c.local_tokens, n - sink, cap - sink)
            k = b - sink - local
        return sink, local, max(0, min(k, n - sink - local))

    def select_decode(self, ctx: SeqContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> TokenSelection:
        n, h_kv, dev = ctx.n, k.shape[0], k.device
        sink, local, top = self.budget(n)
        score = self.scores(ctx, q, k, v)  # hashes the new keys even when nothing is scored
        parts = [torch.arange(sink, device=dev).expand(h_kv, -1)]
        if top:
            order = torch.sort(score[:, sink: n - local], dim=-1, descending=True, stable=True).indices
            parts.append(order[:, :top] + sink)
        parts.append(torch.arange(n - local, n, device=dev).expand(h_kv, -1))
        idx = torch.cat(parts, 1).sort(dim=-1).values  # disjoint parts: deduplicated, width sink+local+top
        return TokenSelection(idx.to(torch.int32).contiguous(), 1)

    # ---- batched decode over per-page bucket ids and value norms ------------------------------------
    # The same selection as ``select_decode`` for a whole decode batch, in fixed shapes and without host reads,
    # so it runs inside a captured CUDA graph. The hash index is kept per physical page and KV head
    # (``page_pools``), keyed by what fixes the hash, so a prompt starting from cached pages finds its prefix
    # hashed already; ``update_state`` hashes each step's new keys into their slots (on GPUs straight from the
    # cache pages into the id pool); ``decode_select`` takes the group-reduced bucket distributions of every
    # row at once (``kernels/lsh_probs.py`` on GPUs), the collision scores of every key through the page table
    # (``kernels/paged_collision.py``; skipped where no row scores a token) with the sinks and local window
    # written as forced (+inf), then the top-k of the middle in one ``select_list``, each row's (sink, local,
    # k) from ``_budget_rows``, the budget rule on device.
    @property
    def uses_value_norms(self) -> bool:
        """Whether the scorer multiplies by ||v_j|| (the published factor): only then are norms computed and kept."""
        return self.config.value_norm and not self.config.hard

    def page_pools(self, layer: int, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per cache page and KV head: the L bucket ids of each slot ``[h_kv, L, page]`` and, where the scorer
        uses them, ``||v||`` of each slot ``[h_kv, page]`` (else None), keyed by what fixes the hash (seed,
        tables, planes, the shard's heads)."""
        c, h_kv = self.config, cache.num_kv_heads
        key = ("socket", layer, c.seed, c.tables, c.planes, self.kv_head_offset)
        ids = cache.page_pool(key + ("ids",), (h_kv, c.tables, cache.page_size), lsh.bucket_dtype(c.planes))
        if not self.uses_value_norms:
            return ids, None
        return ids, cache.page_pool(key + ("norm",), (h_kv, cache.page_size), torch.float32)

    def update_state(self, layer: int, cache: KVCache, batch: BatchMeta) -> None:
        """Hashes the step's new keys into their slots (a rollback's rewritten slots are rehashed too): on GPUs
        one launch that reads the keys from their pages and writes the ids in place."""
        ids_pool, norm_pool = self.page_pools(layer, cache)
        pages, offs = batch.slot_pages, batch.slot_offsets
        keys = cache.k[layer]
        w = self.planes_for(layer, keys.shape[1], keys.device)
        lsh_bucket_ids_into_slots(w, keys, pages, offs, ids_pool)
        if norm_pool is not None:
            norm_pool[pages, :, offs] = torch.linalg.vector_norm(cache.v[layer][pages, :, offs].float(), dim=-1)

    def batch_bucket_probs(self, layer: int, q: torch.Tensor, h_kv: int) -> torch.Tensor:
        """``Socket.bucket_probs`` of every row at once: q [B, h, d] -> [B, h_kv, L, R] (``dispatch.lsh_bucket_probs``:
        on GPUs one launch)."""
        c = self.config
        w = self.planes_for(layer, h_kv, q.device)
        return lsh_bucket_probs(w, q, c.tau, hard=c.hard, reduce=c.group_reduce, out_dtype=PROB_DTYPES[c.probs])

    def _budget_rows(self, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``Socket.budget`` on device for lengths n [B, 1]: (sink, local, k)."""
        c = self.config
        sink = n.clamp(max=c.sink_tokens)
        local = (n - sink).clamp(max=c.local_tokens)
        if c.top_k is not None:
            k = torch.full_like(n, c.top_k)
        else:
            b = row_budget(self.layer_density, n)
            cap = (b.double() * c.forced_share).floor().long()
            over = cap < sink + local
            shrunk = torch.minimum(sink, cap * c.sink_tokens // max(1, c.sink_tokens + c.local_tokens))
            sink = torch.where(over, shrunk, sink)
            local = torch.where(over, torch.minimum((n - sink).clamp(max=c.local_tokens), cap - sink), local)
            k = b - sink - local
        return sink, local, torch.minimum(k.clamp(min=0), n - sink - local)

    def plan_layers(self, cache: KVCache, batch: BatchMeta) -> SocketStep | None:
        """A batched decode step's budget, the same at every sparse layer (one density for all of them): each
        row's forced sink and local window [B] (the scorer writes them as +inf, the list selection's forced
        encoding), each (row, KV head)'s k [B h_kv], and off Triton the forced and past-the-length tokens' bias
        of the collision scores. None for a prefill, or a decode on the per-sequence path."""
        if batch.is_prefill or self.tracer is not None:
            return None
        kv, _ = cache.paged(0, batch)
        h_kv, width = cache.num_kv_heads, kv.page_table.shape[1] * cache.page_size
        sink, local, top = self._budget_rows(kv.seqlens.long()[:, None])
        sink, local, top = sink.flatten(), local.flatten(), top.expand(-1, h_kv).flatten()
        k_max = self.budget(width)[2] if self.config.top_k is None else min(self.config.top_k, width)
        # q and the pools live on the cache's device
        bias = collision_bias((sink, local), kv.seqlens, width, cache.k[0]) if k_max > 0 else None
        return SocketStep(sink, local, top, bias)

    def decode_select(self, layer: int, q: torch.Tensor, view: DecodeView) -> torch.Tensor:
        """The batch's selection ``[B, h_kv, W]`` (``SparseMethod.decode_select``)."""
        c, width = self.config, view.width_tokens
        ids_pool, norm_pool = self.page_pools(layer, view.cache)
        h_kv = ids_pool.shape[1]
        k_max = self.budget(width)[2] if c.top_k is None else min(c.top_k, width)
        step = self.layer_plan(view.cache, view.batch)
        sink, local, top = step.sink, step.local, step.top
        if k_max == 0:
            # No row of the bucket scores a token (the budget holds no more than the sinks and the local window,
            # k non-decreasing in n): the selection is the forced tokens, so the collision scores are not computed.
            forced = forced_tokens(sink, local, view.seqlens, width)
            score = torch.where(forced, math.inf, -math.inf)[:, None].expand(-1, h_kv, -1).contiguous()
        else:
            probs = self.batch_bucket_probs(layer, q, h_kv)
            # norm_pool is None unless the scorer uses value norms; the forced sinks and windows come back as +inf
            args = (probs, ids_pool, norm_pool, view.kv.page_table, view.seqlens, (sink, local))
            # the forced and past-the-length tokens' bias is the step's (``plan_layers``)
            score = paged_collision_scores(*args, bias=step.bias)
        out_width = min(width, min(c.sink_tokens, width) + min(c.local_tokens, width) + k_max)
        return select_list(score.flatten(0, 1), top, k_max, max(out_width, 1)).view(*score.shape[:2], -1)

    def decode_keys(self, layer: int, n: int) -> int:
        return sum(self.budget(n))

    # ---- SparseMethod ---------------------------------------------------------------------------
    def prefill_seq(self, ctx: SeqContext, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Dense attention (full density). The batched decode's hash index is the per-page pools, which
        ``update_state`` fills; the per-sequence reference index is built lazily by ``select_decode``, and
        only an index that exists is rehashed here (from ``q_start``: a rollback's rewritten slots), so the
        runtime path hashes each key once."""
        if "socket_buckets" in ctx.state:
            self.update_index(ctx, k, v)
        return dense_attention(q, k, v), float(causal_pairs(q.shape[0], ctx.n) * k.shape[0])

    def attended_keys(self, ctx: SeqContext, sel: TokenSelection) -> float:
        return float(sel.indices.numel())  # no SENTINEL: every row holds exactly the width

    # ---- capacity accounting --------------------------------------------------------------------
    def metadata_bytes_per_token_per_layer(self, num_kv_heads: int | None = None) -> int:
        """Bytes this method adds to the KV cache per token in one sparse layer: L bucket ids (1 byte each
        for P <= 8, else 2) + the fp32 value norm where the scorer uses it, per KV head (``num_kv_heads``: this
        shard's count)."""
        h_kv = num_kv_heads or self.model_cfg.num_kv_heads
        id_bytes = torch.tensor([], dtype=lsh.bucket_dtype(self.config.planes)).element_size()
        return h_kv * (self.config.tables * id_bytes + (NORM_BYTES if self.uses_value_norms else 0))

    def metadata_bytes_per_token(self, num_kv_heads: int | None = None) -> int:
        """Per token over all layers (dense layers store nothing): KVCache's ``metadata_bytes_per_token``."""
        sparse = len(self.sparse_layers())
        return sparse * self.metadata_bytes_per_token_per_layer(num_kv_heads)


class SocketHard(Socket):
    name = "socket_hard"
    config_cls = SocketHardConfig


register(method_spec(Socket, "SOCKET: soft-LSH key scores (bucket ids + value norms) pick top-k tokens in decode"))
register(method_spec(SocketHard, "SOCKET ablation: hard LSH (exact bucket-collision counts) at the same budget"))
