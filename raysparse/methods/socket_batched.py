"""SOCKET's batched decode step (``socket.py`` holds the method: its budget rule, hash index and per-sequence
reference ``select_decode``).

The same selection as ``Socket.select_decode`` for a whole decode batch, in fixed shapes and without host
reads, so it runs inside a captured CUDA graph:

- Hash index per page (``page_pools``): the bucket ids of every cache slot, and its value norm where the scorer
  uses it, are kept per physical page and KV head, keyed by what fixes the hash (seed, tables, planes, the
  shard's heads). So with prefix caching (``prefix_state = "pages"``) a prompt starting from cached pages finds
  its prefix hashed already.
- ``hash_step_keys`` (``Socket.update_state``): each step hashes its new keys into their slots (a rollback's
  rewritten slots are rehashed too), on GPUs straight from the cache pages into the id pool.
- ``batched_select`` (``Socket.decode_select``): the group-reduced bucket distributions of every row at once
  (``kernels/lsh_probs.py`` on GPUs), the collision scores of every key through the page table
  (``kernels/paged_collision.py``: Triton on GPUs, its PyTorch form else; skipped where no row scores a
  token) with the sinks and local window written as forced (+inf), then the top-k of the middle in one
  ``select_list``, each row's (sink, local, k) from ``budget_rows``, the budget rule on device.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from raysparse.kernels.dispatch import triton_wanted
from raysparse.kernels.lsh_probs import MAX_PLANES, bucket_probs
from raysparse.kernels.lsh_scorer import bucket_ids_into_slots
from raysparse.kernels.paged_collision import forced_bias, forced_tokens, paged_collision, paged_collision_torch
from raysparse.kernels.row_select import select_list
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods import lsh
from raysparse.methods.budget import row_budget
from raysparse.methods.views import DecodeView

if TYPE_CHECKING:
    from raysparse.methods.socket import Socket


def page_pools(method: Socket, layer: int, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per cache page and KV head: the L bucket ids of each slot ``[h_kv, L, page]`` and, where the scorer
    uses them, ``||v||`` of each slot ``[h_kv, page]`` (else None), keyed by what fixes the hash (seed,
    tables, planes, the shard's heads)."""
    c, h_kv = method.config, cache.num_kv_heads
    key = ("socket", layer, c.seed, c.tables, c.planes, method.kv_head_offset)
    ids = cache.page_pool(key + ("ids",), (h_kv, c.tables, cache.page_size), lsh.bucket_dtype(c.planes))
    if not method.uses_value_norms:
        return ids, None
    return ids, cache.page_pool(key + ("norm",), (h_kv, cache.page_size), torch.float32)


def hash_step_keys(method: Socket, layer: int, cache: KVCache, batch: BatchMeta) -> None:
    """Hashes the step's new keys into their slots (a rollback's rewritten slots are rehashed too): on GPUs
    one launch that reads the keys from their pages and writes the ids in place."""
    ids_pool, norm_pool = page_pools(method, layer, cache)
    pages, offs = batch.slot_pages, batch.slot_offsets
    keys = cache.k[layer]
    w = method.planes_for(layer, keys.shape[1], keys.device)
    if triton_wanted(keys, ids_pool):
        bucket_ids_into_slots(w, keys, pages, offs, ids_pool)
    else:
        ids = lsh.bucket_ids(w, keys[pages, :, offs].transpose(0, 1))  # [h_kv, L, T]
        ids_pool[pages, :, :, offs] = ids.permute(2, 0, 1).to(ids_pool.dtype)
    if norm_pool is not None:
        norm_pool[pages, :, offs] = torch.linalg.vector_norm(cache.v[layer][pages, :, offs].float(), dim=-1)


def batch_bucket_probs(method: Socket, layer: int, q: torch.Tensor, h_kv: int) -> torch.Tensor:
    """``Socket.bucket_probs`` of every row at once: q [B, h, d] -> [B, h_kv, L, R] (on GPUs one launch,
    ``kernels/lsh_probs.py``)."""
    c = method.config
    b, h, d = q.shape
    w = method.planes_for(layer, h_kv, q.device)
    if triton_wanted(q, w) and c.planes <= MAX_PLANES:
        return bucket_probs(w, q, c.tau, hard=c.hard, reduce=c.group_reduce)
    qg = q.view(b, h_kv, h // h_kv, d).permute(1, 0, 2, 3).reshape(h_kv, -1, d)  # [h_kv, B * g, d]
    p = lsh.hard_bucket_probs(w, qg) if c.hard else lsh.soft_bucket_probs(w, qg, c.tau)
    p = p.view(h_kv, b, h // h_kv, *p.shape[2:])
    p = p.mean(2) if c.group_reduce == "mean" else p.amax(2)
    return p.transpose(0, 1)


def budget_rows(method: Socket, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Socket.budget`` on device for lengths n [B, 1]: (sink, local, k)."""
    c = method.config
    sink = n.clamp(max=c.sink_tokens)
    local = (n - sink).clamp(max=c.local_tokens)
    if c.top_k is not None:
        k = torch.full_like(n, c.top_k)
    else:
        b = row_budget(method.layer_density, n)
        cap = (b.double() * c.forced_share).floor().long()
        over = cap < sink + local
        shrunk = torch.minimum(sink, cap * c.sink_tokens // max(1, c.sink_tokens + c.local_tokens))
        sink = torch.where(over, shrunk, sink)
        local = torch.where(over, torch.minimum((n - sink).clamp(max=c.local_tokens), cap - sink), local)
        k = b - sink - local
    return sink, local, torch.minimum(k.clamp(min=0), n - sink - local)


def step_rows(method: Socket, view: DecodeView) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step's per-row budget, the same at every sparse layer (one density for all of them), so computed
    by the step's first SOCKET layer and kept in ``batch.extras``: each row's forced sink and local window
    [B] (the scorer writes them as +inf, the list selection's forced encoding) and each (row, KV head)'s k
    [B h_kv]."""
    h_kv = view.kv.k.shape[1]
    key = ("socket-step", id(method), h_kv)  # the method's frozen config fixes the rule
    got = view.batch.extras.get(key)
    if got is None:
        sink, local, top = budget_rows(method, view.seqlens.long()[:, None])
        got = view.batch.extras[key] = (sink.flatten(), local.flatten(), top.expand(-1, h_kv).flatten())
    return got


def batched_select(method: Socket, layer: int, q: torch.Tensor, view: DecodeView) -> torch.Tensor:
    """The batch's selection ``[B, h_kv, W]`` (``SparseMethod.decode_select``)."""
    c, width = method.config, view.width_tokens
    ids_pool, norm_pool = page_pools(method, layer, view.cache)
    h_kv = ids_pool.shape[1]
    k_max = method.budget(width)[2] if c.top_k is None else min(c.top_k, width)
    sink, local, top = step_rows(method, view)
    if k_max == 0:
        # No row of the bucket scores a token (the budget holds no more than the sinks and the local window,
        # k non-decreasing in n): the selection is the forced tokens, so the collision scores are not computed.
        forced = forced_tokens(sink, local, view.seqlens, width)
        score = torch.where(forced, math.inf, -math.inf)[:, None].expand(-1, h_kv, -1).contiguous()
    else:
        probs = batch_bucket_probs(method, layer, q, h_kv)
        # norm_pool is None unless the scorer uses value norms; the forced sinks and windows come back as +inf
        args = (probs, ids_pool, norm_pool, view.kv.page_table, view.seqlens, (sink, local))
        if triton_wanted(q, ids_pool):
            score = paged_collision(*args)
        else:  # the forced and past-the-length tokens' bias is the step's, the same at every layer: built once
            key = ("socket-bias", id(method), width)
            bias = view.batch.extras.get(key)
            if bias is None:
                bias = view.batch.extras[key] = forced_bias((sink, local), view.seqlens, width)
            score = paged_collision_torch(*args, bias=bias)
    out_width = min(width, min(c.sink_tokens, width) + min(c.local_tokens, width) + k_max)
    return select_list(score.flatten(0, 1), top, k_max, max(out_width, 1)).view(*score.shape[:2], -1)
