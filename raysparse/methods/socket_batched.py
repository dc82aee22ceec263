"""SOCKET's batched decode step (``socket.py`` holds the method: its budget rule, hash index and per-sequence
reference ``select_decode``).

The same selection as ``Socket.select_decode`` for a whole decode batch, in fixed shapes and without host
reads, so it runs inside a captured CUDA graph:

- Hash index per page (``page_pools``): the bucket ids of every cache slot, and its value norm where the scorer
  uses it, are kept per physical page and KV head, keyed by what fixes the hash (seed, tables, planes, the
  shard's heads). So with prefix caching (``prefix_state = "pages"``) a prompt starting from cached pages finds
  its prefix hashed already.
- ``hash_step_keys`` (``Socket.update_state``): each step hashes its new keys into their slots (a rollback's
  rewritten slots are rehashed too).
- ``batched_select`` (``Socket.decode_select``): each row's (sink, local, k), the budget rule on device
  (``budget_rows``); the group-reduced bucket distributions of every row at once; the collision scores of every
  key through the page table, written in the list's encoding (sinks and local window +inf, past the length
  -inf: ``kernels/paged_collision.py``); the top-k of the middle in one ``select_list``. Where no row scores a
  token the lists are the forced tokens, built directly (``forced_lists``). On GPUs (``triton_wanted``) that is
  four launches: the budgets and the distributions (``kernels/socket_step.py``), the scores and the list; the
  PyTorch forms run elsewhere and are the kernels' oracles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from raysparse.kernels.dispatch import triton_wanted
from raysparse.kernels.paged_collision import paged_collision, paged_collision_torch
from raysparse.kernels.row_select import select_list
from raysparse.kernels.socket_step import group_bucket_probs, step_budgets
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods import lsh
from raysparse.methods.base import DecodeView, row_budget

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
    """Hashes the step's new keys into their slots (a rollback's rewritten slots are rehashed too)."""
    ids_pool, norm_pool = page_pools(method, layer, cache)
    pages, offs = batch.slot_pages, batch.slot_offsets
    k = cache.k[layer][pages, :, offs]  # [T, h_kv, d]
    w = method.planes_for(layer, k.shape[1], k.device)
    ids = lsh.bucket_ids(w, k.transpose(0, 1))  # [h_kv, L, T]
    ids_pool[pages, :, :, offs] = ids.permute(2, 0, 1).to(ids_pool.dtype)
    if norm_pool is not None:
        norm_pool[pages, :, offs] = torch.linalg.vector_norm(cache.v[layer][pages, :, offs].float(), dim=-1)


def batch_bucket_probs(method: Socket, layer: int, q: torch.Tensor, h_kv: int) -> torch.Tensor:
    """``Socket.bucket_probs`` of every row at once: q [B, h, d] -> [B, h_kv, L, R], in one launch
    (``kernels/socket_step.py``) where ``triton_wanted``, else ``bucket_probs_torch``."""
    c = method.config
    w = method.planes_for(layer, h_kv, q.device)
    if triton_wanted(q, w):
        return group_bucket_probs(w, q, c.tau, c.hard, c.group_reduce == "max")
    return bucket_probs_torch(w, q, c.tau, c.hard, c.group_reduce)


def bucket_probs_torch(w: torch.Tensor, q: torch.Tensor, tau: float, hard: bool, reduce: str) -> torch.Tensor:
    """The PyTorch form (the CPU path and the kernel's oracle): ``lsh``'s soft or hard bucket probabilities of
    every query head, then the mean or max over each KV head's group. w [h_kv, L, P, d], q [B, h, d] -> fp32
    [B, h_kv, L, R]."""
    b, h, d = q.shape
    h_kv = w.shape[0]
    qg = q.view(b, h_kv, h // h_kv, d).permute(1, 0, 2, 3).reshape(h_kv, -1, d)  # [h_kv, B * g, d]
    p = lsh.hard_bucket_probs(w, qg) if hard else lsh.soft_bucket_probs(w, qg, tau)
    p = p.view(h_kv, b, h // h_kv, *p.shape[2:])
    p = p.mean(2) if reduce == "mean" else p.amax(2)
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


def batch_budgets(method: Socket, seqlens: torch.Tensor, h_kv: int,
                fast: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's (sink [B], local [B]) and scored count per (row, KV head) [B * h_kv] for lengths [B]: one launch
    (``kernels/socket_step.py``) where ``fast``, else ``budget_rows``."""
    c = method.config
    if fast:
        return step_budgets(seqlens, h_kv, c.sink_tokens, c.local_tokens, c.top_k, method.layer_density,
                            c.forced_share)
    sink, local, top = budget_rows(method, seqlens.long()[:, None])
    return sink.view(-1), local.view(-1), top.expand(-1, h_kv).flatten()


def forced_lists(sink: torch.Tensor, local: torch.Tensor, n: torch.Tensor, h_kv: int, width: int) -> torch.Tensor:
    """``select_list``'s answer where no token is scored (k = 0 in every row): each row's sinks, then its local
    window, -1 after; sink, local, n [B] -> int32 [B, h_kv, width]."""
    i = torch.arange(width, device=n.device)
    s, loc = sink.long()[:, None], local.long()[:, None]
    lists = torch.where(i < s, i, torch.where(i < s + loc, i - s + (n.long()[:, None] - loc), -1))
    return lists.to(torch.int32)[:, None].expand(-1, h_kv, -1).contiguous()


def batched_select(method: Socket, layer: int, q: torch.Tensor, view: DecodeView) -> torch.Tensor:
    """The batch's selection ``[B, h_kv, W]`` (``SparseMethod.decode_select``)."""
    c, width = method.config, view.width_tokens
    ids_pool, norm_pool = page_pools(method, layer, view.cache)
    h_kv = ids_pool.shape[1]
    k_max = method.budget(width)[2] if c.top_k is None else min(c.top_k, width)
    out_width = max(1, min(width, min(c.sink_tokens, width) + min(c.local_tokens, width) + k_max))
    fast = triton_wanted(q, ids_pool)
    sink, local, kk = batch_budgets(method, view.seqlens, h_kv, fast)
    if k_max == 0:
        # No row of the bucket scores a token (the budget holds no more than the sinks and the local window,
        # k non-decreasing in n): the selection is the forced tokens, so the collision scores are not computed.
        return forced_lists(sink, local, view.seqlens, h_kv, out_width)
    probs = batch_bucket_probs(method, layer, q, h_kv)
    # The list selection's encoding, written by the scorer: +inf forced (sinks, local window), -inf past the
    # row's length, the collision score (times ||v|| where the scorer uses it: norm_pool else None) between.
    scorer = paged_collision if fast else paged_collision_torch
    score = scorer(probs, ids_pool, norm_pool, view.kv.page_table, view.seqlens, sink=sink, local=local)
    return select_list(score.flatten(0, 1), kk, k_max, out_width).view(*score.shape[:2], -1)
