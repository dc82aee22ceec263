"""Quest's page bounds as per-page state of the paged cache: per cache page, KV head and Quest page of ``page``
tokens, the element-wise min and max of its keys (K's dtype: min and max are exact), in ``KVCache.page_pool``.

Quest (``quest.py``) scores its decode and prefill pages from them; CIS's page retrieval (``cis_pages.py``) ranks
the pages it scores exactly by them. The pool's key names the layer and the Quest page alone, so two methods
keeping the bounds of one cache share one pool (``page_pool``: equal keys, equal contents). Kept per page, a
prompt that starts from cached pages finds its prefix's bounds there.
"""

from __future__ import annotations

import torch

from raysparse.kernels.dispatch import update_quest_bounds
from raysparse.kv_cache import BatchMeta, KVCache


def bound_pools(cache: KVCache, layer: int, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's (min, max) pools, each [num_pages + 1, h_kv, cache page // page, d] (K's dtype)."""
    if cache.page_size % page:
        raise ValueError(f"a Quest page of {page} tokens must divide the cache's pages of {cache.page_size}")
    per_page = (cache.num_kv_heads, cache.page_size // page, cache.cfg.head_dim)
    key = ("quest", layer, page)
    return (cache.page_pool(key + ("min",), per_page, cache.dtype),
            cache.page_pool(key + ("max",), per_page, cache.dtype))


def closing_rows(batch: BatchMeta, page: int, device: torch.device) -> torch.Tensor:
    """The packed rows of a prefill step whose token closes a Quest page of ``page`` tokens or ends its
    sequence's chunk, from the host's positions (a sequence's new tokens end at ``ctx_lens``): one copy per
    step, where a mask read back per layer would wait for the device at every layer."""
    rows: list[int] = []
    for i, (q_len, n) in enumerate(zip(batch.q_lens, batch.ctx_lens, strict=True)):
        lo, row0 = n - q_len, batch.cu_q[i]
        first = lo + (page - 1 - lo % page)  # the first closing position at or after lo
        rows.extend(range(row0 + first - lo, row0 + q_len - 1, page))
        rows.append(row0 + q_len - 1)
    host = torch.tensor(rows, dtype=torch.long)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def update_bounds(cache: KVCache, layer: int, batch: BatchMeta, page: int, rows: torch.Tensor | None) -> None:
    """Recomputes the bounds of each Quest page the step's tokens end in (its keys up to the newest): every row
    of a decode step, and in prefill the ``rows`` that close a page or end a chunk (``closing_rows``)."""
    pages, offs = batch.slot_pages, batch.slot_offsets
    if batch.is_prefill:
        assert rows is not None, "a prefill step's bounds update needs its closing rows"
        pages, offs = pages[rows], offs[rows]
    lo_pool, hi_pool = bound_pools(cache, layer, page)
    update_quest_bounds(cache.k[layer], lo_pool, hi_pool, pages, offs, page)
