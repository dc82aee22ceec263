"""The sparse selection format shared by every method and every kernel.

Prefill (``BlockSelection``): for one sequence, per KV head and per query block, the ascending list of
key blocks to attend, padded at the end with ``SENTINEL``. Query block ``r`` of the selection is the
absolute block ``q_start // block_size + r`` of the sequence, so chunked prefill works unchanged.

Decode (``TokenSelection``): for one sequence, per KV head, the ascending list of key indices (tokens,
or blocks of ``block_size`` tokens) to attend, padded with ``SENTINEL``.

Both are deduplicated and causal by construction when built through ``indices_from_mask``; the query
heads of a KV head share its list (native GQA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SENTINEL = -1


@dataclass(frozen=True)
class BlockSelection:
    indices: torch.Tensor  # int32 [h_kv, n_qblocks, max_sel]
    block_size: int

    @property
    def counts(self) -> torch.Tensor:
        return (self.indices != SENTINEL).sum(-1)


@dataclass(frozen=True)
class TokenSelection:
    indices: torch.Tensor  # int32 [h_kv, max_sel]
    block_size: int = 1  # 1: token indices; B: indices of B-token blocks

    @property
    def counts(self) -> torch.Tensor:
        return (self.indices != SENTINEL).sum(-1)

    def to_tokens(self, n: int) -> TokenSelection:
        """The same selection as token indices below ``n``."""
        if self.block_size == 1:
            return self
        offs = torch.arange(self.block_size, device=self.indices.device)
        tok = self.indices[..., :, None].long() * self.block_size + offs
        valid = (self.indices[..., :, None] != SENTINEL) & (tok < n)
        return TokenSelection(pad_sorted(tok.flatten(-2), valid.flatten(-2)), 1)


def pad_sorted(values: torch.Tensor, valid: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """Ascending valid values of each row, padded at the end with SENTINEL.

    ``values`` must be non-negative and unique among the valid entries of a row. Without ``width`` the
    result is as wide as the fullest row, which costs one host sync; hot paths pass the budget instead.
    """
    big = torch.iinfo(torch.int64).max
    keyed = torch.where(valid, values.long(), torch.full_like(values, big, dtype=torch.long))
    if width is None:
        width = int(valid.sum(-1).max().item()) if valid.numel() else 0
    ordered = keyed.sort(dim=-1).values[..., : max(width, 1)]
    return torch.where(ordered == big, torch.full_like(ordered, SENTINEL), ordered).to(torch.int32)


def indices_from_mask(mask: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """Boolean mask [..., n] -> ascending indices of the True entries, padded with SENTINEL."""
    idx = torch.arange(mask.shape[-1], device=mask.device).expand(mask.shape)
    return pad_sorted(idx, mask, width)


def mask_from_indices(indices: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of ``indices_from_mask``: [..., max_sel] -> boolean [..., n]."""
    mask = torch.zeros(*indices.shape[:-1], n + 1, dtype=torch.bool, device=indices.device)
    slot = torch.where(indices == SENTINEL, torch.full_like(indices, n), indices).long()
    mask.scatter_(-1, slot, True)
    return mask[..., :n]


def topk_mask(scores: torch.Tensor, k: int | torch.Tensor, allowed: torch.Tensor,
              forced: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask of ``forced`` plus the top-``k`` allowed, non-forced entries of each row by score.

    ``k`` may be an int or a per-row tensor (broadcast over the leading dims). Ties break toward lower
    indices; rows with fewer than k candidates keep all of them.
    """
    forced = torch.zeros_like(allowed) if forced is None else forced & allowed
    candidates = allowed & ~forced
    neg_inf = torch.finfo(torch.float32).min
    s = torch.where(candidates, scores.float(), torch.full_like(scores, neg_inf, dtype=torch.float32))
    kmax = int(k if isinstance(k, int) else k.max().item())
    kmax = max(0, min(kmax, s.shape[-1]))
    chosen = torch.zeros_like(allowed)
    if kmax:
        order = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :kmax]
        rank_ok = torch.arange(kmax, device=s.device) < (k if isinstance(k, int) else k[..., None])
        take = rank_ok & candidates.gather(-1, order)
        chosen.scatter_(-1, order, take)
    return chosen | forced


def block_pairs(indices: torch.Tensor, block_size: int, q_start: int, n: int) -> torch.Tensor:
    """Causal (query, key) pairs covered by a BlockSelection's indices, per KV head: [h_kv]."""
    h_kv, nqb, _ = indices.shape
    b = block_size
    q0 = (q_start // b) * b
    qpos = q0 + torch.arange(nqb * b, device=indices.device).view(nqb, b)  # [nqb, B]
    qvalid = (qpos >= q_start) & (qpos < n)
    kb = indices.long().clamp(min=0)[..., None]  # [h, nqb, S, 1]
    k_lo = kb * b
    k_hi = torch.minimum(torch.minimum(k_lo + b, torch.tensor(n)), qpos[None, :, None, :] + 1)
    cnt = (k_hi - k_lo).clamp(min=0) * qvalid[None, :, None, :]
    cnt = cnt * (indices != SENTINEL)[..., None]
    return cnt.sum(dim=(1, 2, 3))


def packed_block_pairs(indices: torch.Tensor, qblock: torch.Tensor, q_start: torch.Tensor, n: torch.Tensor,
                       block_size: int) -> torch.Tensor:
    """Causal (query, key) pairs of each packed query block's list, summed over KV heads: [R] int64.

    ``indices`` [h_kv, R, S] (a ``PackedBlockSelection``'s), ``qblock`` [R] the absolute query block of each
    row, ``q_start`` and ``n`` [R] its sequence's first new position and length. ``block_pairs`` counted per
    row without materialising a pair grid: a listed block below the query block holds B keys (only the last
    block can be partial, and it is never below a query block), each seen by every valid query of the
    block; the diagonal block gives each valid query the keys up to itself."""
    b = block_size
    lo = torch.maximum(qblock * b, q_start)  # the block's first and last valid query positions
    hi = torch.minimum(qblock * b + b, n) - 1
    rows = (hi - lo + 1).clamp(min=0)
    listed = indices.long()
    below = ((listed != SENTINEL) & (listed < qblock[None, :, None])).sum((0, 2))
    diag = (listed == qblock[None, :, None]).sum((0, 2))
    tri = ((lo - qblock * b + 1) + (hi - qblock * b + 1)) * rows // 2  # sum over valid queries of keys to itself
    return rows * b * below + tri * diag
