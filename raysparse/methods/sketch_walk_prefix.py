"""Sketch&Walk's state for the prefix cache: a prompt that starts from cached pages rebuilds its prefill state.

Sketch&Walk's prefill state is per sequence (block sketches, A_hat rows, the walk), so every prefill also keeps
each block's query and key-part sketch sums per page (a block is a page; for the paired scorings the key parts
are the batched decode's own page-indexed sums, ``sketch_walk_parts``, not a second copy). A prompt starting at
a cached prefix of p tokens takes the p / B blocks' sums from its pages and recomputes the prefix's A_hat rows
as a whole prefill computes them, where its walk reads them; one hop with paired scoring reads only the new
query blocks' rows (row-wise weights) and the decode only the key parts, so those rows stay zero there.
"""

from __future__ import annotations

import torch

from raysparse.kv_cache import KVCache
from raysparse.methods.sketch_walk_method import SketchWalkMethod
from raysparse.methods.sketch_walk_walk import block_counts
from raysparse.methods.views import SeqContext


def prefix_pools(method: SketchWalkMethod, layer: int, cache: KVCache, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-page query sums [pages + 1, width] and key-part sums [pages + 1, sub_blocks, width] of a layer."""
    from raysparse.methods.sketch_walk_parts import PartsDecode

    key = ("sketch_walk_prefix", layer, method.config, method.head_reduce is not None)
    parts = method.config.sub_blocks
    qpool = cache.page_pool((*key, "q"), (width,), torch.float32)
    dec = method.batch_decoder
    if isinstance(dec, PartsDecode) and layer in dec.index and dec.ks[0, 0].numel() == width:
        return qpool, dec.ks[dec.index[layer]].view(-1, parts, width)  # the same sums: no second copy
    return qpool, cache.page_pool((*key, "k"), (parts, width), torch.float32)


def store_prefix(method: SketchWalkMethod, ctx: SeqContext, cache: KVCache, pages: torch.Tensor, qb0: int, nb: int
                 ) -> None:
    """Keeps blocks qb0..nb-1's sums (just updated by the prefill) in their pages."""
    st, parts = ctx.state, method.config.sub_blocks
    width = st["qs"][0].numel()
    qpool, kpool = prefix_pools(method, ctx.layer, cache, width)
    at = pages[qb0:nb].to(qpool.device)
    qpool[at] = st["qs"].reshape(-1, width)[qb0:nb]
    kpool[at] = st["ks"].reshape(-1, parts, width)[qb0:nb]


def adopt_prefix(method: SketchWalkMethod, ctx: SeqContext, cache: KVCache, pages: torch.Tensor) -> None:
    """This layer's state for a prompt whose first ``q_start`` tokens are cached pages: their blocks' sums from
    the pages, their A_hat rows recomputed where a walk reads them (as ``_update_sketch`` computes them: under
    tensor parallelism the same all-reduce, on every shard). Also how a per-sequence step rebuilds the batched
    prefill's page-indexed state (``sketch_walk_batch``; its last block may be partial)."""
    cfg, q0 = method.config, ctx.q_start
    B, parts, r = cfg.block_size, cfg.sub_blocks, method.srht.sketch_dim
    paged = ctx.state.get("paged")  # the batched prefill's state: the pages hold q_start tokens' sums
    if paged and ctx.state["n"] != q0:
        raise NotImplementedError(
            f"sketch_walk: layer {ctx.layer} has sketches of {ctx.state['n']} tokens but the step starts at "
            f"position {q0}; prefill must start at 0 or continue a sequence this backend has seen")
    if q0 % B and not paged:
        raise RuntimeError(f"sketch_walk: a cached prefix of {q0} tokens does not end on a block")
    nb = -(-q0 // B)
    per_head = cfg.heads != "mean"
    hs = cache.num_kv_heads if per_head else 1
    qpool, kpool = prefix_pools(method, ctx.layer, cache, hs * r)
    at = pages[:nb].to(qpool.device)
    qs, ks = qpool[at].view(nb, hs, r), kpool[at].view(nb * parts, hs, r)
    dev = qs.device
    if cfg.walk == "one-hop" and per_head:
        # never read: not recomputed (at a 64K-token prefix, O(blocks^2 * sub_blocks) scores per layer)
        a_hat = torch.zeros(hs if cfg.heads == "kv" else 1, nb, nb, dtype=torch.bfloat16, device=dev)
    else:
        k_cnt = block_counts(q0, nb * parts, B // parts, dev)
        rows, _ = method._scores(qs / block_counts(q0, nb, B, dev)[:, None, None],
                                 ks / k_cnt.clamp(min=1)[:, None, None], k_cnt > 0)
        causal = torch.ones(nb, nb, dtype=torch.bool, device=dev).tril()
        a_hat = rows.masked_fill(~causal, 0.0).to(torch.bfloat16)
    ctx.state.pop("paged", None)
    ctx.state.update(qs=qs if per_head else qs[:, 0], ks=ks if per_head else ks[:, 0],
                     a_hat=a_hat if cfg.heads == "kv" else a_hat.view(nb, nb), n=q0)


def sequence_state(method: SketchWalkMethod, cache: KVCache, layer: int, seq_id: int) -> dict:
    """A sequence's state at ``layer`` in the per-sequence layout (qs, ks, a_hat, n), whichever path kept it:
    the batched prefill's page-indexed state is read from its pages (A_hat zero, as one hop never reads it);
    the metadata itself is left as it is."""
    st = cache.metadata[layer][seq_id]
    if not st.get("paged"):
        return st
    ctx = SeqContext(layer, seq_id, st["n"], st["n"], dict(st))
    adopt_prefix(method, ctx, cache, cache.page_table(seq_id))
    return ctx.state
