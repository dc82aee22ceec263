"""Sketch&Walk's paired part scores for a decode step in two launches (the graph path,
``sketch_walk_parts``, before its heads are combined), or in one launch with the heads' partial
combine (``part_combine``, which ``kernels/part_select.py`` finalises and selects from).

The state is page-indexed like the KV cache: ``ks`` [(num_pages + 1) * P, h_kv, r] per sparse layer, part p
of KV page g at row g * P + p (the last page is the cache's scratch page, where padded rows write). A row
finds its parts through the step's page table [bsz, w] (device page ids): part c of row b is row
table[b, c // P] * P + c % P. A part starts fresh when the new token is its first ((n - 1) % size == 0):
the new key's sketch is stored there, not added, since a page reused from a freed sequence holds stale sums.

The PyTorch form (``part_scores_reference``, the graph path's own math) writes the new key's sketch into its
part sum, gathers every row's part sums [bsz, w * P, h_kv, r], divides a materialised copy by the part
counts, takes the einsum with the per-KV-head query sketches and masks the empty parts: the part sums
(~33 MB per layer and row at 64K for h_kv = 8, r = 128, P = 8) are read and written several times.

``_score_kernel`` (batch rows x tiles of parts x KV heads, so a long row is spread over many programs) reads
each row's part sums once, updates its own part in registers, dots each part's sum with the query sketch,
divides by the part count and by sqrt(r) (IEEE divisions) and writes the score [h_kv, bsz, w * P] fp32,
-inf for a part that holds no token. It does not store the sum: a padded row's program may read a part of
the shared scratch page that another padded row updates. ``_store_kernel`` (one program per batch row)
then stores the updated part sums. Real rows hold distinct pages; padded rows (length 1, every table entry
the scratch page) share the scratch page's first part, where the result is any of their updates.

Agreement: the dot product is summed in another order than the reference's einsum, the count divides the
dot product instead of each element (the same for a full part: its count is a power of two) and the
reference may divide by sqrt(r) as a multiplication by its reciprocal on CUDA, so a score may differ from
it by fp32 rounding; the empty parts and the stored sums are the reference's exactly.

The query may be each KV head's group mean (one sketch per KV head) or every query head's own sketch
(``decode_query="heads"``: G per KV head, scored against the same part sums, loaded once per KV head).

``_combine_kernel`` (batch rows x tiles of parts; the KV heads and their query sketches in a loop, so a part's
scores never reach memory) writes this shard's partial of ``SketchWalk._combine_heads`` [bsz, w * P] fp64: per
part the sum over its query sketches, in head order, of exp(score) ("pair-lse"; 0 for an empty part) or of
the score ("pair"; -inf for an empty part), each score in fp32 as above and summed in fp64. Only the program whose tile
holds a row's current part reads that part, so it stores the updated sums itself, after the heads' loop (a
store inside it would keep the next head's loads from being issued before it): one launch.
"""

from __future__ import annotations

import math

import torch

from .common import interpreting, tl, triton

if triton is not None:

    @triton.jit
    def _tile_parts(TABLE, N, b, cols, s_t, SIZE: tl.constexpr, P: tl.constexpr, WID: tl.constexpr):
        """A tile of one row's parts: (state rows, parts holding a token, the new token's part, whether it is
        that part's first token, the part counts)."""
        nn = tl.load(N + b)
        cur = (nn - 1) // SIZE  # the new token's part
        ok = (cols < (nn + SIZE - 1) // SIZE) & (cols < WID)  # parts holding a token
        # int64 rows: a layer's state can exceed 2^31 elements for large caches
        page = tl.load(TABLE + b * s_t + cols // P, mask=ok, other=0).to(tl.int64)
        cnt = tl.minimum(tl.maximum(nn - cols * SIZE, 1), SIZE).to(tl.float32)
        return page * P + cols % P, ok, cols == cur, (nn - 1) % SIZE == 0, cnt

    @triton.jit
    def _head_keys(KS, K, b, h, row, ok, here, fresh, s_k0, s_k1, H_KV: tl.constexpr, R: tl.constexpr):
        """KV head h's part sums of a tile, the new key folded into its part in registers (a store here could
        land before another program's load)."""
        rr = tl.arange(0, R)
        ptr = KS + row[:, None] * s_k0 + h * s_k1 + rr[None, :]
        kt = tl.load(ptr, mask=ok[:, None], other=0.0)
        return tl.where(here[:, None], tl.where(fresh, 0.0, kt) + tl.load(K + (b * H_KV + h) * R + rr)[None, :], kt)

    @triton.jit
    def _query_scores(kt, Q, qh, ok, cnt, sqrt_r, R: tl.constexpr):
        """Query sketch row ``qh``'s scores of a tile's part sums ``kt``; empty parts -inf."""
        # the mean's division after the dot: one per part, not per element (exact alike for power-of-two counts)
        s = tl.div_rn(tl.div_rn(tl.sum(kt * tl.load(Q + qh * R + tl.arange(0, R))[None, :], 1), cnt), sqrt_r)
        return tl.where(ok, s, float("-inf"))

    @triton.jit
    def _store_part(KS, K, b, row, fresh, s_k0, s_k1, H_KV: tl.constexpr, HP: tl.constexpr, R: tl.constexpr):
        """Row b's new key sketches [H_KV, R] into its current part (state row ``row``): stored over the
        part's stale sums when the token is the part's first (``fresh``), added otherwise."""
        hh = tl.arange(0, HP)
        rr = tl.arange(0, R)
        mask = (hh < H_KV)[:, None]
        at = KS + row * s_k0 + hh[:, None] * s_k1 + rr[None, :]
        new = tl.load(K + (b * H_KV + hh[:, None]) * R + rr[None, :], mask=mask, other=0.0)
        tl.store(at, tl.where(fresh, 0.0, tl.load(at, mask=mask, other=0.0)) + new, mask=mask)

    @triton.jit
    def _score_kernel(KS, TABLE, N, Q, K, S, s_t, s_k0, s_k1, bsz, sqrt_r,
                      SIZE: tl.constexpr, P: tl.constexpr, H_KV: tl.constexpr, G: tl.constexpr, R: tl.constexpr,
                      WID: tl.constexpr, TP: tl.constexpr):
        b = tl.program_id(0)
        cols = tl.program_id(1) * TP + tl.arange(0, TP)
        hq = tl.program_id(2)  # a query sketch row: KV head hq // G
        row, ok, here, fresh, cnt = _tile_parts(TABLE, N, b, cols, s_t, SIZE, P, WID)
        kt = _head_keys(KS, K, b, hq // G, row, ok, here, fresh, s_k0, s_k1, H_KV, R)
        s = _query_scores(kt, Q, b * H_KV * G + hq, ok, cnt, sqrt_r, R)
        tl.store(S + (hq * bsz + b) * WID + cols, s, mask=cols < WID)

    @triton.jit
    def _store_kernel(KS, TABLE, N, K, s_t, s_k0, s_k1,
                      SIZE: tl.constexpr, P: tl.constexpr, H_KV: tl.constexpr, HP: tl.constexpr, R: tl.constexpr):
        b = tl.program_id(0)
        nn = tl.load(N + b)
        cur = (nn - 1) // SIZE
        row = tl.load(TABLE + b * s_t + cur // P).to(tl.int64) * P + cur % P
        _store_part(KS, K, b, row, (nn - 1) % SIZE == 0, s_k0, s_k1, H_KV, HP, R)

    @triton.jit
    def _combine_kernel(KS, TABLE, N, Q, K, X, s_t, s_k0, s_k1, sqrt_r,
                        SIZE: tl.constexpr, P: tl.constexpr, H_KV: tl.constexpr, HP: tl.constexpr, G: tl.constexpr,
                        R: tl.constexpr, WID: tl.constexpr, TP: tl.constexpr, LSE: tl.constexpr):
        b = tl.program_id(0)
        cols = tl.program_id(1) * TP + tl.arange(0, TP)
        row, ok, here, fresh, cnt = _tile_parts(TABLE, N, b, cols, s_t, SIZE, P, WID)
        acc = tl.zeros([TP], dtype=tl.float64)
        for h in tl.static_range(H_KV):  # no store in the loop: every head's loads may be in flight at once
            kt = _head_keys(KS, K, b, h, row, ok, here, fresh, s_k0, s_k1, H_KV, R)
            for j in tl.static_range(G):  # the query sketches of KV head h (one: its group's mean)
                s = _query_scores(kt, Q, (b * H_KV + h) * G + j, ok, cnt, sqrt_r, R).to(tl.float64)
                if LSE:
                    s = tl.exp(s)
                acc += s
        tl.store(X + b * WID + cols, acc, mask=cols < WID)
        mine = here & ok
        if tl.sum(mine.to(tl.int32), 0) > 0:  # this tile holds the new token's part: store its updated sums
            _store_part(KS, K, b, tl.sum(tl.where(mine, row, 0), 0), fresh, s_k0, s_k1, H_KV, HP, R)


def _check(ks: torch.Tensor, table: torch.Tensor, n: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
           parts: int) -> None:
    r = q.shape[-1]
    if (r & (r - 1) or ks.dim() != 3 or ks.shape[1:] != k.shape[1:] or ks.stride(-1) != 1 or ks.shape[0] % parts
            or q.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[1] % k.shape[1] or q.shape[2] != r
            or table.dim() != 2 or table.shape[0] != q.shape[0] or table.stride(1) != 1
            or table.dtype != torch.int32 or n.dtype != torch.long):
        raise ValueError("part_scores needs a power-of-two sketch dim, ks [pages * P, h_kv, r] with unit last "
                         "stride, k [bsz, h_kv, r] and q [bsz, h_kv * G, r], an int32 page table [bsz, w] with "
                         "unit column stride and int64 lengths")


def part_rows(table: torch.Tensor, parts: int) -> torch.Tensor:
    """The state row of every part of every row [bsz, w * P] (int64): table[b, c // P] * P + c % P."""
    cols = torch.arange(table.shape[1] * parts, device=table.device)
    return table.long()[:, cols // parts] * parts + cols % parts


def part_constants(n: torch.Tensor, size: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the new token's part [bsz], the part counts [bsz, width] (>= 1) and the parts holding a token."""
    cols = torch.arange(width, device=n.device)
    cnt = (n[:, None] - cols * size).clamp(min=1, max=size).float()
    return (n - 1) // size, cnt, cols < ((n + size - 1) // size)[:, None]


def part_scores_reference(ks: torch.Tensor, table: torch.Tensor, n: torch.Tensor, q: torch.Tensor,
                          k: torch.Tensor, size: int, parts: int,
                          consts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                          rows: torch.Tensor | None = None) -> torch.Tensor:
    """The PyTorch form and the kernels' oracle: writes ``k`` into each row's current part of ``ks`` in place
    (stored if it is the part's first token, else added) and returns the scores [h_kv, bsz, w * P] fp32 (-inf
    for empty parts). Arguments as ``part_scores``; ``consts`` (``part_constants(n, size, w * P)``) and
    ``rows`` (``part_rows(table, parts)``) if already built (the graph path builds them once a step)."""
    width = table.shape[1] * parts
    part, cnt, filled = consts if consts is not None else part_constants(n, size, width)
    rows = rows if rows is not None else part_rows(table, parts)
    cur = rows.gather(1, part[:, None]).squeeze(1)
    fresh = ((n - 1) % size == 0)[:, None, None]
    # real rows' current parts are distinct rows; padded rows share the scratch page's (any one wins)
    ks[cur] = torch.where(fresh, 0.0, ks[cur]) + k
    k_mean = ks[rows] / cnt[:, :, None, None]  # [bsz, width, h_kv, r]
    qg = q.unflatten(1, (k.shape[1], -1))  # [bsz, h_kv, G, r]: G query sketches per KV head
    s = torch.einsum("bhgr,bjhr->hgbj", qg, k_mean).flatten(0, 1) / math.sqrt(q.shape[-1])
    return s.masked_fill(~filled[None], -math.inf)


def _tile(width: int, tile: int | None, cap: int, div: int, floor: int = 16) -> int:
    wp = 1 << max(width - 1, 0).bit_length()
    if tile is None:  # the interpreter pays per program: one tile per row there
        tile = min(wp, 1024) if interpreting() else max(floor, min(cap, wp // div))
    if tile & (tile - 1):
        raise ValueError(f"tile must be a power of two, got {tile}")
    return tile


def part_scores(ks: torch.Tensor, table: torch.Tensor, n: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                size: int, parts: int, out: torch.Tensor | None = None, tile: int | None = None) -> torch.Tensor:
    """ks [(num_pages + 1) * P, h_kv, r] fp32: one sparse layer's page-indexed part sums (a view; unit last
    stride); table [bsz, w] int32: each row's KV pages (unit column stride; padded rows: the scratch page);
    n [bsz] int64: each row's length (the new token included); k [bsz, h_kv, r] fp32: the new token's key
    sketches per KV head; q [bsz, h_kv * G, r] fp32: its query sketches, G per KV head (KV-head major; G = 1:
    each group's mean); ``size`` tokens per part, ``parts`` (P) per page. Writes ``k`` into each row's
    current part of ``ks`` and returns the scores [h_kv * G, bsz, w * P] fp32 (in ``out`` if given,
    contiguous). ``tile``: parts per program (a power of two; default by width)."""
    bsz, hq, r = q.shape
    _check(ks, table, n, q, k, parts)
    h_kv = k.shape[1]
    q, k = q.float().contiguous(), k.float().contiguous()
    width = table.shape[1] * parts
    if out is None:
        out = torch.empty(hq, bsz, width, dtype=torch.float32, device=q.device)
    tile = _tile(width, tile, 64, 32)
    _score_kernel[(bsz, -(-width // tile), hq)](ks, table, n, q, k, out, table.stride(0), ks.stride(0),
                                                ks.stride(1), bsz, math.sqrt(r), SIZE=size, P=parts, H_KV=h_kv,
                                                G=hq // h_kv, R=r, WID=width, TP=tile, num_warps=4)
    _store_kernel[(bsz,)](ks, table, n, k, table.stride(0), ks.stride(0), ks.stride(1), SIZE=size, P=parts,
                          H_KV=h_kv, HP=1 << max(h_kv - 1, 0).bit_length(), R=r, num_warps=4)
    return out


def part_combine(ks: torch.Tensor, table: torch.Tensor, n: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 size: int, parts: int, heads: str, out: torch.Tensor | None = None,
                 tile: int | None = None) -> torch.Tensor:
    """As ``part_scores`` (the same arguments and state update), but returns this shard's partial head
    combine [bsz, w * P] fp64 (in ``out`` if given, contiguous): per part the sum over the query sketches
    (KV heads, G each) of exp(score) for ``heads="pair-lse"``, of the score for ``"pair"``; what
    ``_combine_heads`` reduces. Each KV head's part sums are loaded once for its G queries."""
    if heads not in ("pair", "pair-lse"):
        raise ValueError(f"part_combine combines heads 'pair' or 'pair-lse', got {heads!r}")
    bsz, hq, r = q.shape
    _check(ks, table, n, q, k, parts)
    h_kv = k.shape[1]
    q, k = q.float().contiguous(), k.float().contiguous()
    width = table.shape[1] * parts
    if out is None:
        out = torch.empty(bsz, width, dtype=torch.float64, device=q.device)
    # every head of a tile in one program: small tiles for many programs in flight (on the H200, 8 parts a
    # program took 0.79x the time of 32 at batch 8 and 64K, 0.87x at batch 1, the same at 16K)
    tile = _tile(width, tile, 8, 1, floor=8)
    _combine_kernel[(bsz, -(-width // tile))](ks, table, n, q, k, out, table.stride(0), ks.stride(0), ks.stride(1),
                                              math.sqrt(r), SIZE=size, P=parts, H_KV=h_kv,
                                              HP=1 << max(h_kv - 1, 0).bit_length(), G=hq // h_kv, R=r,
                                              WID=width, TP=tile,
                                              LSE=heads == "pair-lse", num_warps=4)
    return out
