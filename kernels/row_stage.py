"""A decode selection's keys staged through the K/V tiers in a few launches: ``dst`` rows of a staging buffer laid
out by logical page, each key's row read from the device pool's slot where its page is resident, else from the
layer's row cache, else from the (pinned) host tier, which the row cache then keeps, least recently used out.

What it replaces: the same staging written as PyTorch ops (``KVTiers._stage_torch`` with ``RowCache``'s
``lookup`` and ``place``, the oracle of ``tests/test_row_stage.py``) costs about a hundred small launches per
tiered layer, each a few microseconds inside a captured step whatever the selection's size, so at batch 1 a
tiered layer's staging cost several times its attention. Here it is about ten: the key pass (``_stage_kernel``:
each key's token, page and source, the cache hits' stamps, each host-read row's first entry by an atomic
minimum), one row copy per source (``row_copy``: pool slots, row cache, host tier), the first entries marked
(``_want_kernel``), their ranks (a cumulative sum), the slots oldest first (a stable sort of the stamps, as the
reference), the placement (``_place_kernel``: evictions, both maps, the stamps) and the placed rows copied from the
staging buffer into their slots. Counts are atomics into the tiers' device counters. Shapes are fixed by the
selection's size and nothing is read back to the host, so a captured decode step replays it. The index kernels
are one-dimensional and the copies ``row_copy``'s: Triton 3.6 miscompiles a kernel that uses one 1-D mask both
alone and broadcast against the row's columns (its two layouts do not match), which a fused copy would need.

Layout (the caller's, ``KVTiers``): every K/V tensor is viewed as rows of ``d``; the staging buffer has a page for
every logical page of the batch plus a scratch page (``row * width + logical``), the pool and host tier are indexed
by ``(page * h_kv + head) * page_size + offset``, the row cache by slot. A host source on a GPU must be pinned
(read in place, as ``row_copy``).
"""

from __future__ import annotations

import torch

from .common import tl, triton
from .row_copy import copy_rows

if triton is not None:

    @triton.jit
    def _stage_kernel(indices, seqlens, table, counted, smap, slot_of, stamp, tick, from_slot, from_cache, missing,
                      at, claim, counts, H_KV, W, WIDTH, SCRATCH, LAYER_STEPS, UNIT: tl.constexpr,
                      PAGE: tl.constexpr, ROWS: tl.constexpr, CACHE: tl.constexpr, COUNT_LIVE: tl.constexpr):
        bh = tl.program_id(0)
        blk = tl.program_id(1)
        b = bh // H_KV
        h = bh % H_KV
        n_keys = W * UNIT
        t = blk * ROWS + tl.arange(0, ROWS)
        inb = t < n_keys
        idx = tl.load(indices + bh * W + t // UNIT, mask=inb, other=-1).to(tl.int64)
        seqlen = tl.load(seqlens + b).to(tl.int64)
        live = tl.load(table + b * WIDTH).to(tl.int64) != SCRATCH  # a captured step's padded row stages nothing
        tok = idx * UNIT + t % UNIT
        ok = inb & (idx >= 0) & (tok < seqlen) & live
        logical = tl.maximum(tok, 0) // PAGE
        off = tl.maximum(tok, 0) % PAGE
        hp = tl.load(table + b * WIDTH + logical, mask=ok, other=0).to(tl.int64)
        slot = tl.load(smap + hp, mask=ok, other=-1).to(tl.int64)
        hit = ok & (slot >= 0)
        miss = ok & (slot < 0)
        dst = ((b * WIDTH + logical) * H_KV + h) * PAGE + off
        hrow = (hp * H_KV + h) * PAGE + off
        n = bh * n_keys + t
        if CACHE:
            cs = tl.load(slot_of + hrow, mask=miss, other=-1).to(tl.int64)
            cached = miss & (cs >= 0)
            from_host = miss & (cs < 0)
            tl.store(stamp + cs, tl.load(tick) + 0 * cs, mask=cached)  # read by this call: kept by the placement
            tl.atomic_min(claim + hrow, n.to(tl.int32), mask=from_host, sem="relaxed")  # the row's first entry
            tl.store(from_cache + n, tl.where(cached, cs, -1), mask=inb)
        else:
            cached = miss & (slot > 0)  # none without a row cache (a miss's slot is negative)
            from_host = miss
        # the three sources are disjoint; -1 where a key takes another (the copies skip it)
        tl.store(from_slot + n, tl.where(hit, (slot * H_KV + h) * PAGE + off, -1), mask=inb)
        tl.store(missing + n, tl.where(from_host, hrow, -1), mask=inb)
        tl.store(at + n, tl.where(ok, dst, -1), mask=inb)
        if COUNT_LIVE:
            cnt = live
        else:
            cnt = tl.load(counted + b) != 0
        first = (h == 0) & (blk == 0)
        tl.atomic_add(counts + 0, cnt.to(tl.int64), mask=first, sem="relaxed")  # (layer, row) pairs staged
        tl.atomic_add(counts + 1, tl.sum((ok & cnt).to(tl.int64), 0), sem="relaxed")  # their keys
        tl.atomic_add(counts + 2, tl.sum(from_host.to(tl.int64), 0), sem="relaxed")  # rows read from the host
        if CACHE:
            tl.atomic_add(counts + 3, tl.sum(cached.to(tl.int64), 0), sem="relaxed")  # from the row cache
        tl.atomic_add(counts + 5, LAYER_STEPS + 0 * b, mask=first & (b == 0), sem="relaxed")

    @triton.jit
    def _want_kernel(missing, claim, want, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        r = tl.load(missing + i, mask=live, other=-1)
        first = tl.load(claim + tl.maximum(r, 0), mask=live & (r >= 0), other=-1) == i
        tl.store(want + i, ((r >= 0) & first).to(tl.int32), mask=live)

    @triton.jit
    def _place_kernel(missing, want, rank, order, slot_of, owner, stamp, tick, claim, into, counts, n, SLOTS,
                      BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        r = tl.load(missing + i, mask=live, other=-1)
        w = tl.load(want + i, mask=live, other=0) != 0
        k = tl.load(rank + i, mask=live, other=1) - 1
        take = w & (k < SLOTS)
        cand = tl.load(order + tl.maximum(k, 0), mask=take, other=0)
        tk = tl.load(tick)
        take = take & (tl.load(stamp + cand, mask=take, other=0) != tk)  # a slot this call reads stays
        old = tl.load(owner + cand, mask=take, other=-1)
        gone = take & (old >= 0)
        # distinct ranks give distinct slots, and a row read from the host owns no slot: no two entries write one
        tl.store(slot_of + tl.maximum(old, 0), tl.full(old.shape, -1, tl.int32), mask=gone)
        tl.store(owner + cand, r, mask=take)
        tl.store(slot_of + tl.maximum(r, 0), cand.to(tl.int32), mask=take)
        tl.store(stamp + cand, tk + 0 * cand, mask=take)
        tl.store(into + i, tl.where(take, cand, -1), mask=live)
        free = tl.full(r.shape, 2147483647, tl.int32)  # CLAIM_FREE: the claims back for the next call
        tl.store(claim + tl.maximum(r, 0), free, mask=live & (r >= 0))
        tl.atomic_add(counts + 4, tl.sum(gone.to(tl.int64), 0), sem="relaxed")  # rows the cache evicted


def stage_rows(indices: torch.Tensor, unit: int, seqlens: torch.Tensor, table: torch.Tensor,
               counted: torch.Tensor | None, smap: torch.Tensor, pool: tuple[torch.Tensor, torch.Tensor],
               host: tuple[torch.Tensor, torch.Tensor], staging: tuple[torch.Tensor, torch.Tensor],
               counts: torch.Tensor, *, scratch_page: int | None = None, layer_steps: int = 0,
               cache: tuple[torch.Tensor, ...] | None = None) -> None:
    """Stages a decode selection ``indices`` [B, h_kv, W] (entries of ``unit`` tokens, negative: none) of rows of
    lengths ``seqlens`` [B] over host pages ``table`` [B, width] into ``staging`` (K, V: [B * width + 1, h_kv,
    page, d]) at each key's logical page. ``smap`` [host pages]: a host page's slot in ``pool`` (K, V: [slots + 1,
    h_kv, page, d]), -1 where not resident; ``host``: the host tier (K, V: [host pages, h_kv, page, d]).
    ``scratch_page``: a captured step's padding page; rows whose table starts with it stage and count nothing.
    ``counted`` [B] (int8; None: every live row): the rows whose keys count as staged. ``cache``: the row cache
    (``slot_of`` [host rows + 1] int32, ``owner`` [slots + 1] int64, ``stamp`` [slots + 1] int64, ``tick`` (this
    call's stamp, already advanced), ``claim`` [host rows + 1] int32 holding int32's maximum (``RowCache``'s
    ``CLAIM_FREE``), its rows K and V
    [slots, d]), None: none. Adds to ``counts`` (int64 [6], the tiers' device counters): rows staged, their
    keys, rows read from the host, rows read from the cache, rows the cache evicted, ``layer_steps``."""
    b, h_kv, w = indices.shape
    width = table.shape[1]
    sk, sv = staging
    page = sk.shape[-2]
    n = b * h_kv * w * unit
    if n == 0:
        return
    indices, seqlens, table = indices.contiguous(), seqlens.contiguous(), table.contiguous()
    dev = sk.device
    rows = 256  # keys a program
    from_slot, missing, at = (torch.empty(n, dtype=torch.int64, device=dev) for _ in range(3))
    if cache is not None:
        slot_of, owner, stamp, tick, claim, rk, rv = cache
        from_cache = torch.empty(n, dtype=torch.int64, device=dev)
    else:  # pointers the kernel does not touch (CACHE off): any device tensor will do, none allocated for them
        slot_of = owner = stamp = tick = from_cache = claim = counts
    grid = (b * h_kv, triton.cdiv(w * unit, rows))
    _stage_kernel[grid](indices, seqlens, table, counted if counted is not None else counts, smap, slot_of, stamp,
                        tick, from_slot, from_cache, missing, at, claim, counts, h_kv, w, width,
                        -1 if scratch_page is None else scratch_page, layer_steps, UNIT=unit, PAGE=page, ROWS=rows,
                        CACHE=cache is not None, COUNT_LIVE=counted is None, num_warps=4)
    # the copies: one launch per source, each reading only its keys (``row_copy`` skips the -1 entries)
    copy_rows([(pool[0], sk), (pool[1], sv)], from_slot, at)
    copy_rows([(host[0], sk), (host[1], sv)], missing, at)
    if cache is None:
        return
    copy_rows([(rk, sk), (rv, sv)], from_cache, at)
    want = torch.empty(n, dtype=torch.int32, device=dev)
    block = 1024
    _want_kernel[(triton.cdiv(n, block),)](missing, claim, want, n, BLOCK=block, num_warps=4)
    rank = torch.cumsum(want, 0)
    slots = owner.numel() - 1
    order = torch.argsort(stamp[:slots], stable=True)  # oldest first, ties by the lower slot: the reference's order
    into = torch.empty(n, dtype=torch.int64, device=dev)
    _place_kernel[(triton.cdiv(n, block),)](missing, want, rank, order, slot_of, owner, stamp, tick, claim, into,
                                            counts, n, slots, BLOCK=block, num_warps=4)
    copy_rows([(sk, rk), (sv, rv)], at, into)  # the placed rows into their slots, from the staging buffer
