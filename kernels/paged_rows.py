"""Several decode rows of one sequence over one gather of its selection, in PyTorch ops (the CPU path).

A verification step (SpecAttn) attends ``n`` consecutive new positions of a sequence over one key list: row r
sees the listed keys below its own length. As ``n`` separate decode rows, each row gathers its own copy of
the list's K/V, so a step of gamma + 1 = 5 rows reads the keys five times; on a CPU that gather, not the
products, is most of a decode's attend. Here each sequence's keys are gathered once and its rows attend them
together in one fused flash-attention call, the causal limit a mask.

Rows: ``row_seq`` [T] (the sequence of each row; a sequence's rows consecutive and in order) and ``row_len``
[T] (the keys row r may see: its own length). The selection is per sequence: ``indices`` [S, h_kv, W] in
units of ``unit`` tokens (whole pages when ``unit`` is the page size), ``kv`` the sequences' page table and
lengths. Returns out [T, h, d] (q's dtype) and lse [T, h] (fp32), the same as ``paged_decode_torch`` over
the rows expanded (``kv.page_table[row_seq]``, ``row_len``, ``indices[row_seq]``), its test oracle.
"""

from __future__ import annotations

import torch

from .formats import PagedKV
from .paged_torch import SENTINEL, paged_tiles, selected_tokens, token_rows


def _sequence_keys(kv: PagedKV, indices: torch.Tensor, unit: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sequence's selected keys: K, V [S, h_kv, L, d], their token positions and validity [S, h_kv, L]."""
    page = kv.k.shape[2]
    if unit == page:  # whole pages: page tiles, one index_select each, as the decode's page path
        logical = indices.long().clamp(min=0)
        k, v = paged_tiles(kv.k, kv.page_table, logical), paged_tiles(kv.v, kv.page_table, logical)
        tok = (logical[..., None] * page + torch.arange(page, device=indices.device)).flatten(2)
        ok = ((indices != SENTINEL)[..., None].expand(-1, -1, -1, page).flatten(2)
              & (tok < kv.seqlens.long()[:, None, None]))
        return k, v, tok, ok
    tok, ok = selected_tokens(indices, unit, kv.seqlens)
    k, v = token_rows(kv, tok)
    return k, v, tok, ok


def paged_rows_decode_cpu(q: torch.Tensor, kv: PagedKV, indices: torch.Tensor, unit: int, row_seq: torch.Tensor,
                          row_len: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, h, d]: row r is position ``row_len[r] - 1`` of sequence ``row_seq[r]`` (module docstring)."""
    t, h, d = q.shape
    s, h_kv = indices.shape[:2]
    if t == 0:
        return q.new_zeros(0, h, d), torch.zeros(0, h, device=q.device)
    g = h // h_kv
    k, v, tok, ok = _sequence_keys(kv, indices, unit)
    length = k.shape[2]
    seq = row_seq.long()
    counts = torch.bincount(seq, minlength=s)
    n_max = int(counts.max())  # a host read: this is the CPU's path
    slot = torch.arange(t, device=q.device) - (torch.cumsum(counts, 0) - counts)[seq]
    # The rows laid out [S, n_max]; a padding slot's length is 0, so it sees no key and is dropped below.
    qp = q.new_zeros(s, n_max, h, d)
    qp[seq, slot] = q
    lens = torch.zeros(s, n_max, dtype=torch.long, device=q.device)
    lens[seq, slot] = row_len.long()
    seen = ok[:, :, None, :] & (tok[:, :, None, :] < lens[:, None, :, None])  # [S, h_kv, n_max, L]
    mask = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
    qh = qp.view(s, n_max, h_kv, g, d).permute(0, 2, 3, 1, 4).reshape(s * h_kv, g, n_max, d)
    kh = k.to(q.dtype).reshape(s * h_kv, 1, length, d).expand(-1, g, -1, -1)
    vh = v.to(q.dtype).reshape(s * h_kv, 1, length, d).expand(-1, g, -1, -1)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = op(qh, kh, vh, attn_mask=mask.view(s * h_kv, 1, n_max, length), scale=scale)
    none = ~seen.any(-1)  # [S, h_kv, n_max]: a row with no visible key gets zeros and -inf
    out = out.view(s, h_kv, g, n_max, d).masked_fill(none[:, :, None, :, None], 0.0)
    lse = lse.float().view(s, h_kv, g, n_max).masked_fill(none[:, :, None, :], float("-inf"))
    out = out.permute(0, 3, 1, 2, 4).reshape(s, n_max, h, d)[seq, slot]
    lse = lse.permute(0, 3, 1, 2).reshape(s, n_max, h)[seq, slot]
    return out, lse
