"""Batched decode attention over a selection, read in place from the paged cache, in PyTorch ops only.

The CPU form of ``sparse_decode`` (and its test oracle on ragged batches): every row's selected tokens are
gathered straight from their pages (no per-sequence K/V copy, no host read, no Python loop over rows), so
its cost follows the selection's width, not the context. Fixed shapes throughout, so the same code also
runs inside a captured step.
"""

from __future__ import annotations

import math

import torch

from . import onednn
from .formats import PagedKV

SENTINEL = -1


def selected_tokens(indices: torch.Tensor, unit: int, seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Selection entries [B, h_kv, W] (tokens, or blocks of ``unit`` tokens) -> token ids [B, h_kv, W * unit]
    (0 where invalid) and their validity: the entry is set and the token is below the row's length."""
    offs = torch.arange(unit, device=indices.device, dtype=torch.int64)
    tok = (indices.long()[..., None] * unit + offs).flatten(-2)
    ok = ((indices != SENTINEL)[..., None].expand(*indices.shape, unit).flatten(-2)
          & (tok < seqlens.long()[:, None, None]))
    return torch.where(ok, tok, 0), ok


def paged_tiles(x: torch.Tensor, table: torch.Tensor, logical: torch.Tensor) -> torch.Tensor:
    """One layer's cache x [pages, h_kv, page, d] at whole pages: ``logical`` [B, h_kv, W] page numbers in their
    sequence (``table`` [B, max_pages] its pages), in order: [B, h_kv, W * page, d].

    Rows of the cache seen as [pages * h_kv, page * d], one index_select (advanced indexing with two index
    tensors copies the same tiles markedly slower on a CPU)."""
    h_kv, page, d = x.shape[1:]
    heads = torch.arange(h_kv, device=x.device)[None, :, None]
    pages = table.long().gather(1, logical.flatten(1)).view_as(logical)
    tiles = (pages * h_kv + heads).flatten()
    return x.reshape(-1, page * d).index_select(0, tiles).view(*logical.shape[:2], -1, d)


def in_window(kpos: torch.Tensor, lo: torch.Tensor, sink: int) -> torch.Tensor:
    """Whether keys at ``kpos`` are in a sliding window from ``lo`` up with ``sink`` sinks (causality apart):
    a sink, or at or past the window's bound (broadcast)."""
    return (kpos < sink) | (kpos >= lo)


def token_rows(kv: PagedKV, tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of token ids ``tok`` [B, h_kv, S] (each row's own, per KV head) from the paged cache: [B, h_kv,
    S, d] each, in the cache's dtype.

    One row index into the cache seen as [pages * h_kv * page, d]: a single index_select per tensor, about 2.5x
    faster on a CPU than advanced indexing with three index tensors (the same rows, bit for bit)."""
    h_kv, page, d = kv.k.shape[1:]
    heads = torch.arange(h_kv, device=tok.device)[None, :, None]
    pages = kv.page_table.long().gather(1, (tok // page).flatten(1)).view_as(tok)
    rows = ((pages * h_kv + heads) * page + tok % page).flatten()
    return (kv.k.reshape(-1, d).index_select(0, rows).view(*tok.shape, d),
            kv.v.reshape(-1, d).index_select(0, rows).view(*tok.shape, d))


def paged_decode_torch(q: torch.Tensor, kv: PagedKV, indices: torch.Tensor, unit: int = 1,
                       scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, h, d] (each row's newest position) over its selected keys of the paged cache.

    Returns out [B, h, d] (q's dtype) and lse [B, h] (fp32, natural log). A row with no valid key gets a
    zero output and an lse of -inf."""
    if q.is_cuda:
        return paged_decode_fp32(q, kv, indices, unit, scale)
    # Whole pages (dense layers, block selections) gather page tiles, other units their tokens, and both attend
    # in one fused CPU flash-attention call; ``paged_decode_fp32`` stays the device-agnostic oracle.
    if unit == kv.k.shape[2]:
        return _paged_pages_cpu(q, kv, indices, scale)
    tok, ok = selected_tokens(indices, unit, kv.seqlens)
    k, v = token_rows(kv, tok)
    return _fused_cpu(q, k, v, ok, scale)


# Runs of consecutive pages a CPU dense decode reads in place; a sequence scattered over more is gathered once.
_MAX_RUNS = 8


def page_runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """A sequence's physical pages as runs of consecutive ones: (first logical page, first physical page, count)."""
    runs: list[tuple[int, int, int]] = []
    for i, p in enumerate(pages):
        if runs and runs[-1][1] + runs[-1][2] == p:
            start, first, m = runs[-1]
            runs[-1] = (start, first, m + 1)
        else:
            runs.append((i, p, 1))
    return runs


def host_rows(page_table: torch.Tensor, seqlens: torch.Tensor,
              page: int) -> tuple[tuple[int, tuple[tuple[int, int, int], ...]], ...]:
    """Each row's length and its pages' runs (``page_runs``), read to the host: ``PagedKV.host_rows``."""
    lens = seqlens.tolist()
    table = page_table.tolist()
    return tuple((n, tuple(page_runs(table[i][: -(-n // page)]))) for i, n in enumerate(lens))


def paged_dense_decode_cpu(q: torch.Tensor, kv: PagedKV, scale: float | None = None,
                           want_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [B, h, d] (each row's newest position) over every key of its sequence, on the CPU, read in place.

    Each sequence's pages are read as views of runs of consecutive physical pages (the allocators hand a
    sequence its pages in order, so a run is usually the whole sequence). A run's keys, [pages * h_kv * page,
    d] rows of the cache, take one oneDNN GEMM against all h query heads; the products of a query head with
    another group's keys are thrown away (9 heads, 3 groups: 3x the multiply-adds of a decode row, which
    are not what bounds it, in one streaming pass instead of pages * h_kv tiny products). Then the scores'
    softmax over the whole sequence, and one batched product with the value tiles. Gathering the tiles
    first copies every key and value of the layer at every step and costs more than attending them. Returns
    (out, lse) as ``paged_decode_torch``; lse is None unless ``want_lse`` (dense decode needs none, and a
    plain softmax is fewer operators a layer)."""
    b, h, d = q.shape
    h_kv, page = kv.k.shape[1], kv.k.shape[2]
    g = h // h_kv
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    qs = (q * scale).contiguous()
    out = torch.zeros_like(q)
    lse = torch.full((b, h), -math.inf, dtype=torch.float32, device=q.device) if want_lse else None
    rows = kv.host_rows if kv.host_rows is not None else host_rows(kv.page_table, kv.seqlens, page)
    for i, (n, runs) in enumerate(rows):
        if n <= 0:
            continue
        m = -(-n // page)
        if len(runs) > _MAX_RUNS:
            idx = kv.page_table[i, :m].long()
            tiles = [(kv.k.index_select(0, idx), kv.v.index_select(0, idx))]
        else:
            tiles = [(kv.k[p: p + c], kv.v[p: p + c]) for _, p, c in runs]
        scores = []
        for kt, _ in tiles:  # [c, h_kv, page, d] -> every key row against every query head
            c = kt.shape[0]
            s_all = onednn.linear(kt.to(q.dtype).reshape(-1, d), qs[i])  # [c * h_kv * page, h]
            # each group's own query heads: [c, page, g, h_kv] -> [h_kv, g, c, page]
            scores.append(s_all.view(c, h_kv, page, h_kv, g).diagonal(0, 1, 3).permute(3, 2, 0, 1))
        s = (scores[0] if len(scores) == 1 else torch.cat(scores, dim=2)).reshape(h_kv, g, m * page)
        if n < m * page:
            s[..., n:] = -math.inf
        if lse is not None:
            lse[i] = torch.logsumexp(s.float(), dim=-1).reshape(h)
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype).view(h_kv, g, m, page)
        # the values as the keys: all query heads against a run's [pages * h_kv * page, d] rows, the other
        # groups' rows weighted zero, one GEMM a run
        o, a = None, 0
        for _, vt in tiles:
            c = vt.shape[0]
            wide = q.new_zeros(h_kv, g, c, h_kv, page)
            wide.diagonal(0, 0, 3).copy_(p[:, :, a: a + c].permute(1, 2, 3, 0))
            part = onednn.matmul(wide.view(h, -1), vt.to(q.dtype).reshape(-1, d))
            o, a = part if o is None else o + part, a + c
        out[i] = o.reshape(h, d)
    return out, lse


def paged_decode_fp32(q: torch.Tensor, kv: PagedKV, indices: torch.Tensor, unit: int = 1,
                      scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_decode_torch`` in fp32 products on any device: the selected rows gathered, then scores, a
    log-sum-exp and the weighted values (the CUDA fallback, and the form the fused CPU call replaced)."""
    b, h, d = q.shape
    h_kv = kv.k.shape[1]
    tok, ok = selected_tokens(indices, unit, kv.seqlens)  # [B, h_kv, S]
    k, v = (x.float() for x in token_rows(kv, tok))  # [B, h_kv, S, d]
    qg = q.float().view(b, h_kv, h // h_kv, d)
    s = (qg @ k.transpose(-1, -2)) * (scale if scale is not None else 1.0 / math.sqrt(d))  # [B, h_kv, g, S]
    s = s.masked_fill(~ok[:, :, None, :], -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    out = (p @ v).view(b, h, d)
    return out.to(q.dtype), lse.view(b, h)


def window_pages(window_lo: torch.Tensor, seqlens: torch.Tensor, sink: int, page: int,
                 width: int | None = None) -> torch.Tensor:
    """The pages holding each row's sinks and its window from ``window_lo`` [B] up to its length: int32 [B, W],
    the sinks' pages first, then the window's (which start after the sinks' pages), SENTINEL-padded. ``width``
    fixes W (a captured step's, from its bucket); None takes the batch's widest (a host read)."""
    n = seqlens.long()
    sink_pages = -(-sink // page)
    used = -(-n // page)
    first = (window_lo.long() // page).clamp(min=sink_pages)
    if width is None:
        width = sink_pages + int((used - first).clamp(min=0).max())
    cols = torch.arange(width, device=n.device)[None, :]
    pages = torch.where(cols < sink_pages, cols, first[:, None] + cols - sink_pages)
    return torch.where(pages < used[:, None], pages, SENTINEL).to(torch.int32)


def paged_window_decode_cpu(q: torch.Tensor, kv: PagedKV, window_lo: torch.Tensor, sink: int,
                            scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, h, d] (each row's newest position) over its keys below ``sink`` and from ``window_lo`` [B] up to its
    length: a sliding window with sinks (PSAW's decode), on the CPU. The pages holding those keys are attended
    as whole tiles by the dense decode's fused call and the rest of those pages masked, so the cost follows the
    window's pages, without gathering the window token by token. Returns (out, lse) as ``paged_decode_torch``."""
    pages = window_pages(window_lo, kv.seqlens, sink, kv.k.shape[2])
    indices = pages[:, None, :].expand(-1, kv.k.shape[1], -1)
    return _paged_pages_cpu(q, kv, indices, scale, window_lo, sink)


def _paged_pages_cpu(q: torch.Tensor, kv: PagedKV, indices: torch.Tensor, scale: float | None,
                     window_lo: torch.Tensor | None = None, sink: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    page = kv.k.shape[2]
    logical = indices.long().clamp(min=0)
    k = paged_tiles(kv.k, kv.page_table, logical)
    v = paged_tiles(kv.v, kv.page_table, logical)
    tok = (logical[..., None] * page + torch.arange(page, device=q.device)).flatten(2)
    ok = ((indices != SENTINEL)[..., None].expand(-1, -1, -1, page).flatten(2)
          & (tok < kv.seqlens.long()[:, None, None]))
    if window_lo is not None:  # inside the listed pages, only the sinks and the keys from the row's bound up
        ok &= in_window(tok, window_lo.long()[:, None, None], sink)
    return _fused_cpu(q, k, v, ok, scale)


def _fused_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ok: torch.Tensor,
               scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, h, d] over gathered keys k, v [B, h_kv, S, d] where ``ok`` [B, h_kv, S]: one fused CPU
    flash-attention call, the group's query heads sharing their KV head's rows (an expanded view, no copy).
    Returns (out, lse) as ``paged_decode_torch``: a row with no valid key gets zeros and -inf."""
    b, h, d = q.shape
    h_kv, s = k.shape[1], k.shape[2]
    g = h // h_kv
    k = k.reshape(b * h_kv, 1, s, d).to(q.dtype)
    v = v.reshape(b * h_kv, 1, s, d).to(q.dtype)
    ok = ok.reshape(b * h_kv, 1, 1, s)
    mask = torch.zeros(ok.shape, dtype=q.dtype, device=q.device).masked_fill_(~ok, float("-inf"))
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = op(q.reshape(b * h_kv, g, 1, d), k.expand(-1, g, -1, -1), v.expand(-1, g, -1, -1), attn_mask=mask,
                  scale=scale)
    none = ~ok.view(b * h_kv, -1).any(-1)[:, None, None]  # a row that selects no key: zeros and -inf
    out = out.masked_fill(none[..., None], 0.0).view(b, h, d)
    lse = lse.float().masked_fill(none, float("-inf")).view(b, h)
    return out, lse


def stable_top(score: torch.Tensor, allowed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best allowed entries of each row of fp32 ``score`` [..., N], ties to the lower index (the
    order of a stable descending sort, which is what the per-sequence references use), through one
    ``topk`` over exact int64 keys: the score's order-preserving 32 bits above the inverted index.

    Returns the indices [..., k] (best first) and whether each is allowed (rows may have fewer)."""
    bits = score.float().contiguous().view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()  # monotone in the float's value
    j = torch.arange(score.shape[-1], device=score.device, dtype=torch.int64)
    keys = (ordered << 32) | (0xFFFFFFFF - j)
    keys = torch.where(allowed, keys, torch.iinfo(torch.int64).min)
    k = min(k, score.shape[-1])
    top = torch.topk(keys, k, dim=-1, sorted=True)
    return top.indices, top.values != torch.iinfo(torch.int64).min


_PREFILL_ELEMS = 1 << 24  # gathered K/V elements per chunk of query blocks (bounds the CPU path's memory)
_PREFILL_CHUNK = 8  # query blocks per fused call at most


def _masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor,
                 scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused CPU op's contract in plain ops: (out, lse) of q [N, h, m, d] over k, v [N, h, S, d] with an
    additive mask [N, 1, m, S]; fp32 math."""
    s = (q.float() @ k.float().transpose(-1, -2)) * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    s = s + attn_mask.float()
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return (p @ v.float()).to(q.dtype), lse


def block_sparse_prefill_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                               block: int, scale: float | None = None, window_lo: torch.Tensor | None = None,
                               sink: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse causal attention of one sequence on the CPU: q [n_q, h, d], the last n_q of the n keys in
    k, v [h_kv, n, d]; ``indices`` [h_kv, n_qblocks, S] a ``BlockSelection``'s. Returns out [n_q, h, d] and
    lse [n_q, h] (fp32), zeros and -inf for a row that selects no causal key. ``window_lo`` [n_q]: each row
    sees, inside the listed blocks, only the keys below ``sink`` and from its own bound up.

    Why not the reference's einsum: each query block's selected key blocks are gathered once and every block
    of a chunk attends in one fused flash-attention call with a mask (PyTorch's CPU kernel, which also gives
    the log-sum-exp), so the cost follows the selection, about 3x below dense causal SDPA at density 0.1."""
    n_q, h, d = q.shape
    h_kv, n, _ = k.shape
    g = h // h_kv
    q_start = n - n_q
    qb0, nqb, width = q_start // block, indices.shape[1], indices.shape[2]
    nkb = -(-n // block)
    lead = q_start - qb0 * block
    qf = torch.nn.functional.pad(q, (0, 0, 0, 0, lead, nqb * block - lead - n_q))
    # [nqb, h_kv, g, B, d]: a (query block, KV head) pair is one batch entry of the fused call, its g query
    # heads the call's heads, which share the entry's K/V through a stride-0 view (no copy per query head).
    qf = qf.view(nqb, block, h_kv, g, d).permute(0, 2, 3, 1, 4)
    kf = torch.nn.functional.pad(k, (0, 0, 0, nkb * block - n)).view(h_kv, nkb, block, d)
    vf = torch.nn.functional.pad(v, (0, 0, 0, nkb * block - n)).view(h_kv, nkb, block, d)
    out = torch.empty(nqb, h_kv, g, block, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(nqb, h_kv, g, block, dtype=torch.float32, device=q.device)
    heads = torch.arange(h_kv, device=q.device)[None, :, None]
    offs = torch.arange(block, device=q.device)
    step = max(1, min(_PREFILL_CHUNK, _PREFILL_ELEMS // max(1, h_kv * width * block * d)))
    # A chunk is as wide as its fullest row (host reads are free on the CPU): budgets grow along the
    # sequence, so narrow early chunks skip most of the padding.
    fill = (indices != SENTINEL).sum(-1).amax(0).tolist()
    lo_rows = None
    if window_lo is not None:  # per padded query row, padding rows see nothing extra (they are dropped)
        lo_rows = torch.nn.functional.pad(window_lo.long(), (lead, nqb * block - lead - n_q)).view(nqb, block)
    # PyTorch's fused CPU kernel, which also returns the log-sum-exp; elsewhere (RAYSPARSE_KERNELS=torch on a
    # GPU) the same masked attention in plain ops.
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu if q.device.type == "cpu" else _masked_sdpa
    for c0 in range(0, nqb, step):
        c1 = min(nqb, c0 + step)
        wide = max(1, max(fill[c0:c1]))
        idx = indices[:, c0:c1, :wide].long().transpose(0, 1)  # [c, h_kv, S]
        kg = kf[heads, idx.clamp(min=0)].flatten(2, 3)  # [c, h_kv, S*B, d]
        vg = vf[heads, idx.clamp(min=0)].flatten(2, 3)
        kpos = (idx.clamp(min=0)[..., None] * block + offs).flatten(2)  # [c, h_kv, S*B]
        kvalid = (idx != SENTINEL)[..., None].expand(*idx.shape, block).flatten(2) & (kpos < n)
        qpos = ((qb0 + torch.arange(c0, c1, device=q.device))[:, None] * block + offs)  # [c, B]
        ok = kvalid[:, :, None, :] & (kpos[:, :, None, :] <= qpos[:, None, :, None])  # [c, h_kv, B, S*B]
        if lo_rows is not None:
            ok &= in_window(kpos[:, :, None, :], lo_rows[c0:c1, None, :, None], sink)
        entries = (c1 - c0) * h_kv
        mask = torch.zeros(ok.shape, dtype=q.dtype, device=q.device).masked_fill_(~ok, float("-inf"))
        o, s = op(qf[c0:c1].reshape(entries, g, block, d),
                  kg.to(q.dtype).reshape(entries, 1, -1, d).expand(-1, g, -1, -1),
                  vg.to(q.dtype).reshape(entries, 1, -1, d).expand(-1, g, -1, -1),
                  attn_mask=mask.view(entries, 1, block, -1), scale=scale)
        none = ~ok.any(-1)[:, :, None, :]  # rows that see no key (padding): zeros and -inf, as the reference
        out[c0:c1] = o.view(c1 - c0, h_kv, g, block, d).masked_fill(none[..., None], 0.0)
        lse[c0:c1] = s.float().view(c1 - c0, h_kv, g, block).masked_fill(none, float("-inf"))
    out = out.permute(0, 3, 1, 2, 4).reshape(nqb * block, h, d)[lead: lead + n_q]
    lse = lse.permute(0, 3, 1, 2).reshape(nqb * block, h)[lead: lead + n_q]
    return out, lse
