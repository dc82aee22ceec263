"""A sequence's K/V pages copied out of one paged cache and into another.

SpecAttn's draft actor keeps a full-depth cache of its own. Where it shares one device with the verifier
shards (a CPU machine), prefilling the prompt again would take that device from the verifier for as long as
the verifier's own prefill: the verifier's prompt K/V are the draft's (both prefill densely through every
layer), so the draft copies them instead (``orchestration/spec_step.py``).

- ``export_pages``: the pages holding a sequence's first n tokens, every layer, this cache's KV heads, as
  ``(k, v)`` each ``[layers, pages, h_kv, page, d]`` on the CPU (the tail of the last page is whatever the
  page holds; nothing reads past n).
- ``import_pages``: the parts of every tensor-parallel shard (their KV heads in rank order) written into an
  empty sequence's pages of another cache with the same layers, page size and head dim, and the sequence
  advanced to n tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raysparse.kv_cache import KVCache


def export_pages(cache: KVCache, seq_id: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not 0 < n <= cache.seq_len(seq_id):
        raise ValueError(f"sequence {seq_id} holds {cache.seq_len(seq_id)} tokens; cannot export {n}")
    idx = torch.tensor(cache.page_list(seq_id)[:cache.pages_needed(n)], dtype=torch.long, device=cache.device)
    k = torch.stack([layer.index_select(0, idx) for layer in cache.k])
    v = torch.stack([layer.index_select(0, idx) for layer in cache.v])
    return k.cpu(), v.cpu()


def import_pages(cache: KVCache, seq_id: int, n: int, parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    if cache.seq_len(seq_id) != 0:
        raise ValueError(f"sequence {seq_id} already holds {cache.seq_len(seq_id)} tokens")
    if not parts:
        raise ValueError("no shard's pages to import")
    k = torch.cat([p[0] for p in parts], dim=2)
    v = torch.cat([p[1] for p in parts], dim=2)
    want = (len(cache.k), cache.pages_needed(n), cache.num_kv_heads, cache.page_size, cache.cfg.head_dim)
    if tuple(k.shape) != want or tuple(v.shape) != want:
        raise ValueError(f"sequence {seq_id}: pages of shape {tuple(k.shape)} and {tuple(v.shape)}, "
                         f"this cache holds {want} for {n} tokens")
    cache.prepare([seq_id], [n], True)  # advances the sequence to n tokens (within its reservation)
    idx = torch.tensor(cache.page_list(seq_id)[:want[1]], dtype=torch.long, device=cache.device)
    for layer in range(want[0]):
        cache.k[layer].index_copy_(0, idx, k[layer].to(cache.device, cache.dtype))
        cache.v[layer].index_copy_(0, idx, v[layer].to(cache.device, cache.dtype))
