"""Batched decode attention over a selection, read in place from the paged cache, in PyTorch ops only.

The CPU form of ``sparse_decode`` (and its test oracle on ragged batches): every row's selected tokens are
gathered straight from their pages (no per-sequence K/V copy, no host read, no Python loop over rows), so
its cost follows the selection's width, not the context. Fixed shapes throughout, so the same code also
runs inside a captured step.
"""

from __future__ import annotations

import math

import torch

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


def paged_decode_torch(q: torch.Tensor, kv: PagedKV, indices: torch.Tensor, unit: int = 1,
                       scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, h, d] (each row's newest position) over its selected keys of the paged cache.

    Returns out [B, h, d] (q's dtype) and lse [B, h] (fp32, natural log). A row with no valid key gets a
    zero output and an lse of -inf."""
    b, h, d = q.shape
    h_kv, page = kv.k.shape[1], kv.k.shape[2]
    tok, ok = selected_tokens(indices, unit, kv.seqlens)  # [B, h_kv, S]
    pages = kv.page_table.long().gather(1, (tok // page).flatten(1)).view_as(tok)
    heads = torch.arange(h_kv, device=q.device)[None, :, None]
    k = kv.k[pages, heads, tok % page].float()  # [B, h_kv, S, d]
    v = kv.v[pages, heads, tok % page].float()
    qg = q.float().view(b, h_kv, h // h_kv, d)
    s = (qg @ k.transpose(-1, -2)) * (scale if scale is not None else 1.0 / math.sqrt(d))  # [B, h_kv, g, S]
    s = s.masked_fill(~ok[:, :, None, :], -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    out = (p @ v).view(b, h, d)
    return out.to(q.dtype), lse.view(b, h)


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


def select_list(score: torch.Tensor, kk: torch.Tensor, k_max: int, out_width: int) -> torch.Tensor:
    """Per row of fp32 ``score`` [R, N] (+inf: forced, -inf: excluded, finite: candidate), the ascending columns
    of the forced entries and the ``kk`` [R] best candidates (ties to the lower column), -1 padded to
    ``out_width``: int32 [R, out_width]."""
    cand = torch.isfinite(score)
    order, ok = stable_top(torch.where(cand, score, 0.0), cand, max(k_max, 1))
    ok = ok & (torch.arange(order.shape[-1], device=score.device) < kk[:, None])
    chosen = score == float("inf")
    chosen.scatter_(-1, order, ok | chosen.gather(-1, order))
    cols = torch.arange(score.shape[-1], device=score.device).expand_as(score)
    big = torch.iinfo(torch.int64).max
    picked = torch.where(chosen, cols, big).sort(dim=-1).values[:, :out_width]
    return torch.where(picked == big, SENTINEL, picked).to(torch.int32)
