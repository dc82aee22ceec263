"""Sketch&Walk's paired part scores for a decode step in two launches (the graph path,
``sketch_walk_graph_paired``, before its heads are combined), or in one launch with the heads' partial
combine (``part_combine``, which ``kernels/part_select.py`` finalises and selects from).

The PyTorch form (``part_scores_reference``, the graph path's own math) adds the new key's sketch into its
part sum, gathers every row's part sums ``ks[slots]`` [bsz, w * P, h_kv, r], divides a materialised copy by
the part counts, takes the einsum with the per-KV-head query sketches and masks the empty parts: the part
sums (~33 MB per layer and row at 64K for h_kv = 8, r = 128, P = 8) are read and written several times.

``_score_kernel`` (batch rows x tiles of parts x KV heads, so a long row is spread over many programs) reads
each row's part sums once, adds the new key's sketch into its own part in registers, dots each part's sum
with the query sketch, divides by the part count and by sqrt(r) (IEEE divisions) and writes the score
[h_kv, bsz, w * P] fp32, -inf for a part that holds no token. It does not store the sum: a padded row's
program may read a part of the shared scratch slot that another padded row updates.

``_store_kernel`` (one program per batch row) then stores the updated part sums. Real rows hold distinct
slots; padded rows share the scratch slot, where the result is any mix of their updates (the reference's
duplicate-index write keeps one of them; nothing reads the scratch slot's values as state).

Agreement: the dot product is summed in another order than the reference's einsum, the count divides the
dot product instead of each element (the same for a full part: its count is a power of two) and the
reference may divide by sqrt(r) as a multiplication by its reciprocal on CUDA, so a score may differ from
it by fp32 rounding; the empty parts and the stored sums are the reference's exactly.

``_combine_kernel`` (batch rows x tiles of parts; the KV heads in a loop, so a part's scores never reach
memory) writes this shard's partial of ``SketchWalk._combine_heads`` [bsz, w * P] fp64: per part the sum
over its KV heads, in head order, of exp(score) ("pair-lse"; 0 for an empty part) or of the score ("pair";
-inf for an empty part), each score in fp32 as above and summed in fp64. Only the program whose tile
holds a row's current part reads that part, so it stores the updated sums itself: one launch. Padded rows
share the scratch slot, so one padded row may read another's update there: their scores (never used) may
differ from the reference's, and the scratch slot's current part is any mix of their updates.
"""

from __future__ import annotations

import math

import torch

from .common import interpreting, tl, triton

if triton is not None:

    @triton.jit
    def _score_kernel(KS, SLOTS, N, Q, K, S, s_k0, s_k1, s_k2, bsz, sqrt_r,
                      SIZE: tl.constexpr, H_KV: tl.constexpr, R: tl.constexpr, WID: tl.constexpr, TP: tl.constexpr):
        b = tl.program_id(0)
        cols = tl.program_id(1) * TP + tl.arange(0, TP)
        h = tl.program_id(2)
        slot = tl.load(SLOTS + b)  # int64: a slot's offset exceeds 2^31 elements for large caches
        nn = tl.load(N + b)
        cur = (nn - 1) // SIZE  # the new token's part
        held = (nn + SIZE - 1) // SIZE  # parts holding a token
        rr = tl.arange(0, R)
        at = (b * H_KV + h) * R + rr
        q = tl.load(Q + at)
        ok = (cols < held) & (cols < WID)
        kt = tl.load(KS + slot * s_k0 + cols[:, None] * s_k1 + h * s_k2 + rr[None, :], mask=ok[:, None], other=0.0)
        kt = tl.where((cols == cur)[:, None], kt + tl.load(K + at)[None, :], kt)
        cnt = tl.minimum(tl.maximum(nn - cols * SIZE, 1), SIZE).to(tl.float32)
        # the mean's division after the dot: one per part, not per element (exact alike for power-of-two counts)
        s = tl.div_rn(tl.div_rn(tl.sum(kt * q[None, :], 1), cnt), sqrt_r)
        tl.store(S + (h * bsz + b) * WID + cols, tl.where(ok, s, float("-inf")), mask=cols < WID)

    @triton.jit
    def _store_kernel(KS, SLOTS, N, K, s_k0, s_k1, s_k2,
                      SIZE: tl.constexpr, H_KV: tl.constexpr, HP: tl.constexpr, R: tl.constexpr):
        b = tl.program_id(0)
        slot = tl.load(SLOTS + b)
        cur = (tl.load(N + b) - 1) // SIZE
        hh = tl.arange(0, HP)
        rr = tl.arange(0, R)
        mask = (hh < H_KV)[:, None]
        at = KS + slot * s_k0 + cur * s_k1 + hh[:, None] * s_k2 + rr[None, :]
        new = tl.load(K + (b * H_KV + hh[:, None]) * R + rr[None, :], mask=mask, other=0.0)
        tl.store(at, tl.load(at, mask=mask, other=0.0) + new, mask=mask)


    @triton.jit
    def _combine_kernel(KS, SLOTS, N, Q, K, X, s_k0, s_k1, s_k2, sqrt_r,
                        SIZE: tl.constexpr, H_KV: tl.constexpr, R: tl.constexpr, WID: tl.constexpr, TP: tl.constexpr,
                        LSE: tl.constexpr):
        b = tl.program_id(0)
        cols = tl.program_id(1) * TP + tl.arange(0, TP)
        slot = tl.load(SLOTS + b)
        nn = tl.load(N + b)
        cur = (nn - 1) // SIZE
        held = (nn + SIZE - 1) // SIZE
        rr = tl.arange(0, R)
        ok = (cols < held) & (cols < WID)
        here = (cols == cur)[:, None]
        cnt = tl.minimum(tl.maximum(nn - cols * SIZE, 1), SIZE).to(tl.float32)
        acc = tl.zeros([TP], dtype=tl.float64)
        for h in tl.static_range(H_KV):
            at = (b * H_KV + h) * R + rr
            ptr = KS + slot * s_k0 + cols[:, None] * s_k1 + h * s_k2 + rr[None, :]
            kt = tl.load(ptr, mask=ok[:, None], other=0.0)
            kt = tl.where(here, kt + tl.load(K + at)[None, :], kt)
            s = tl.div_rn(tl.div_rn(tl.sum(kt * tl.load(Q + at)[None, :], 1), cnt), sqrt_r)
            s = tl.where(ok, s, float("-inf")).to(tl.float64)
            if LSE:
                s = tl.exp(s)
            acc += s
            # the stored value depends on the load: the store cannot pass it
            tl.store(ptr, kt, mask=here & ok[:, None])
        tl.store(X + b * WID + cols, acc, mask=cols < WID)


def _check(ks: torch.Tensor, slots: torch.Tensor, n: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
           width: int) -> None:
    r = q.shape[-1]
    if (r & (r - 1) or ks.dim() != 4 or ks.shape[2:] != q.shape[1:] or ks.stride(-1) != 1 or ks.shape[1] < width
            or k.shape != q.shape or slots.dtype != torch.long or n.dtype != torch.long):
        raise ValueError("part_scores needs a power-of-two sketch dim, ks [S, >= width, h_kv, r] with unit last "
                         "stride, q and k [bsz, h_kv, r] and int64 slots and lengths")


def part_constants(n: torch.Tensor, size: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the new token's part [bsz], the part counts [bsz, width] (>= 1) and the parts holding a token."""
    cols = torch.arange(width, device=n.device)
    cnt = (n[:, None] - cols * size).clamp(min=1, max=size).float()
    return (n - 1) // size, cnt, cols < ((n + size - 1) // size)[:, None]


def part_scores_reference(ks: torch.Tensor, slots: torch.Tensor, n: torch.Tensor, q: torch.Tensor,
                          k: torch.Tensor, size: int, width: int,
                          consts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The PyTorch form and the kernels' oracle: adds ``k`` into each row's current part of ``ks`` in place and
    returns the scores [h_kv, bsz, width] fp32 (-inf for empty parts). Arguments as ``part_scores``;
    ``consts``: ``part_constants(n, size, width)`` if already built (the graph path builds them once a step)."""
    part, cnt, filled = consts if consts is not None else part_constants(n, size, width)
    view = ks[:, :width]
    # (slot, part) pairs are distinct across real rows; padded rows share the scratch slot (any one wins)
    view[slots, part] = view[slots, part] + k
    k_mean = view[slots] / cnt[:, :, None, None]  # [bsz, width, h_kv, r]
    s = torch.einsum("bhr,bjhr->hbj", q, k_mean) / math.sqrt(q.shape[-1])
    return s.masked_fill(~filled[None], -math.inf)


def part_scores(ks: torch.Tensor, slots: torch.Tensor, n: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                size: int, width: int, out: torch.Tensor | None = None, tile: int | None = None) -> torch.Tensor:
    """ks [S, >= width, h_kv, r] fp32: one sparse layer's part sums per slot (a view; unit last stride);
    slots / n [bsz] int64: each row's slot and length (the new token included); q / k [bsz, h_kv, r] fp32: the
    new token's query and key sketches per KV head; ``size`` tokens per part; ``width`` parts scored. Adds
    ``k`` into each row's current part of ``ks`` and returns the scores [h_kv, bsz, width] fp32 (in ``out``
    if given, contiguous). ``tile``: parts per program (a power of two; default by width)."""
    bsz, h_kv, r = q.shape
    _check(ks, slots, n, q, k, width)
    q, k = q.float().contiguous(), k.float().contiguous()
    if out is None:
        out = torch.empty(h_kv, bsz, width, dtype=torch.float32, device=q.device)
    wp = 1 << max(width - 1, 0).bit_length()
    if tile is None:  # the interpreter pays per program: one tile per row there
        tile = min(wp, 1024) if interpreting() else max(16, min(64, wp // 32))
    if tile & (tile - 1):
        raise ValueError(f"tile must be a power of two, got {tile}")
    _score_kernel[(bsz, -(-width // tile), h_kv)](ks, slots, n, q, k, out, ks.stride(0), ks.stride(1), ks.stride(2),
                                                  bsz, math.sqrt(r), SIZE=size, H_KV=h_kv, R=r, WID=width, TP=tile,
                                                  num_warps=4)
    _store_kernel[(bsz,)](ks, slots, n, k, ks.stride(0), ks.stride(1), ks.stride(2), SIZE=size, H_KV=h_kv,
                          HP=1 << max(h_kv - 1, 0).bit_length(), R=r, num_warps=4)
    return out


def part_combine(ks: torch.Tensor, slots: torch.Tensor, n: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 size: int, width: int, heads: str, out: torch.Tensor | None = None,
                 tile: int | None = None) -> torch.Tensor:
    """As ``part_scores`` (the same arguments and state update), but returns this shard's partial head
    combine [bsz, width] fp64 (in ``out`` if given, contiguous): per part the sum over the KV heads of
    exp(score) for ``heads="pair-lse"``, of the score for ``"pair"``; what ``_combine_heads`` reduces."""
    if heads not in ("pair", "pair-lse"):
        raise ValueError(f"part_combine combines heads 'pair' or 'pair-lse', got {heads!r}")
    bsz, h_kv, r = q.shape
    _check(ks, slots, n, q, k, width)
    q, k = q.float().contiguous(), k.float().contiguous()
    if out is None:
        out = torch.empty(bsz, width, dtype=torch.float64, device=q.device)
    wp = 1 << max(width - 1, 0).bit_length()
    if tile is None:  # every head of a tile in one program: smaller tiles than part_scores' for as many programs
        tile = min(wp, 1024) if interpreting() else max(16, min(32, wp // 256))
    if tile & (tile - 1):
        raise ValueError(f"tile must be a power of two, got {tile}")
    _combine_kernel[(bsz, -(-width // tile))](ks, slots, n, q, k, out, ks.stride(0), ks.stride(1), ks.stride(2),
                                              math.sqrt(r), SIZE=size, H_KV=h_kv, R=r, WID=width, TP=tile,
                                              LSE=heads == "pair-lse", num_warps=4)
    return out
