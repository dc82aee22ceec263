"""Sketch&Walk's paired decode selection at part granularity in one launch (the graph path,
``sketch_walk_parts``, ``decode_unit="part"``), after ``part_scores.part_combine`` (and, under tensor
parallelism, the ``head_reduce`` all-reduce of its partial).

The PyTorch form, ``SketchWalk._combine_heads`` then ``PartsDecode._choose_parts`` (fp64 exp and sum,
the reduce, clamp, log, cast; then order keys, a masked ``torch.topk``, a concatenation, a sort and a cast:
about 15 kernels per sparse layer), becomes ``_select_kernel``, one program per batch row:

- finalises the reduced partial as ``_combine_heads`` does: "pair" divided by the head count (IEEE fp64
  division), "pair-lse" clamped to fp64's smallest normal and its log taken; then rounded to fp32;
- derives the row's constants from its length alone (``paired_constants``'s): parts holding a token, the
  forced parts (sink and local blocks' filled parts), the budget round-half-even(density * blocks), at least
  1, times P (the product taken exactly in fp64 and rounded to fp32 as PyTorch's fp32 multiply, so no fused
  multiply-add can move a half-way case), and the candidates (filled, not forced);
- picks min(budget - forced, top width, candidates) candidates by (fp32 score descending, part ascending):
  a bisection over the scores' 32-bit order-preserving keys (``order_keys``; -0.0 as 0.0), from the
  candidates' key range, finds a threshold with exactly kk keys at or above it, or else the kk-th largest
  key; everything above it and the first ties in ascending part order (``tl.cumsum``) are taken, so nothing
  is sorted (on the H200, a radix select by ``tl.histogram``, 4 passes of 256 bins, measured 1.5x slower than
  the 32-pass bisection; a 5-way search, four thresholds' counts packed in one int64 reduction, 1.16x slower
  than this one);
- writes the forced parts and the picks ascending (``tl.cumsum`` positions), then -1 up to the width.

Wide rows (at least ``wide_min`` parts, default past ``row_select.SINGLE_MAX``) spread over many programs
instead: one program per row holds the whole row, so at one 131072-token request (16384 parts) a single SM
ran the 32 passes and took 83 us a sparse layer on the H200, more than the attend it serves. There
``_mark_kernel`` (batch rows x tiles of parts) finalises the scores the same way and writes them with the
forced parts as +inf and the non-candidates as -inf, and the row's pick count; ``row_select.select_list``'s
multi-program radix path then lists them. Its contract is this kernel's: the forced entries and the kk best
candidates by (fp32 score descending, part ascending), ascending, -1 padded, so the two paths agree bit for bit.

The list is ``_choose_parts``'s bit for bit on the same fp32 scores, ties included; the fp32 scores agree
with ``_combine_heads``'s except where the fp64 exp or log (libdevice here, PyTorch's own there) or the heads'
summation order moves an fp64 result across an fp32 rounding boundary.
"""

from __future__ import annotations

import torch

from .common import fp32_value, kth_key, next_pow2, row_budget_units, take_at_threshold, tl, triton
from .row_select import SINGLE_MAX, select_list_triton

HEADS = ("pair", "pair-lse")
TINY64 = torch.finfo(torch.float64).tiny  # _combine_heads' clamp before the log


if triton is not None:

    @triton.jit
    def _finalise(x, LSE: tl.constexpr, DIV: tl.constexpr, TINY: tl.constexpr):
        """``_combine_heads``' finalisation of the reduced partial, rounded to fp32."""
        if LSE:
            x = tl.log(tl.maximum(x, tl.full((), TINY, tl.float64)))
        else:  # fp64 `/` is IEEE division (only fp32's is approximate)
            x = x / tl.full((), DIV, tl.float64)
        return x.to(tl.float32)

    @triton.jit
    def _row_parts(nn, cols, inside, SIZE: tl.constexpr, P: tl.constexpr, LOCAL: tl.constexpr):
        """A row's parts from its length: (forced: the sink and local blocks' filled parts, candidates: the
        other filled parts), and its block count."""
        held = (nn + SIZE - 1) // SIZE  # parts holding a token
        nb = (nn + SIZE * P - 1) // (SIZE * P)  # blocks
        blk = cols // P
        filled = (cols < held) & inside
        forced = ((blk == 0) | (blk >= nb - LOCAL)) & filled
        return forced, filled & ~forced, nb

    @triton.jit
    def _mark_kernel(X, N, SCORE, KK, SC, density,
                     SIZE: tl.constexpr, P: tl.constexpr, LOCAL: tl.constexpr, LSE: tl.constexpr,
                     DIV: tl.constexpr, TINY: tl.constexpr, WID: tl.constexpr, K: tl.constexpr,
                     TP: tl.constexpr, SCORES: tl.constexpr):
        b = tl.program_id(0)
        nn = tl.load(N + b)
        cols = tl.program_id(1) * TP + tl.arange(0, TP)
        inside = cols < WID
        x = _finalise(tl.load(X + b * WID + cols, mask=inside, other=0.0), LSE, DIV, TINY)
        if SCORES:
            tl.store(SC + b * WID + cols, x, mask=inside)
        forced, cand, nb = _row_parts(nn, cols, inside, SIZE, P, LOCAL)
        # select_list reads +-inf as forced / excluded, so a candidate's infinite score (a "pair-lse" exp past
        # fp64's range, a "pair" partial of infinite sums) is marked +-FLT_MAX: the same rank, as no finalised
        # score of finite sketches reaches FLT_MAX ("pair-lse" scores are logs of fp64 values, at most 710)
        fmax = 3.4028234663852886e38
        marked = tl.where(forced, float("inf"), tl.where(cand, tl.minimum(tl.maximum(x, -fmax), fmax), float("-inf")))
        tl.store(SCORE + b * WID + cols, marked, mask=inside)
        if tl.program_id(1) == 0:
            # the forced parts lie in block 0 and in blocks nb - LOCAL on, all filled but the last block's
            # tail: min(held, P) + held - max(P, (nb - LOCAL) * P) parts (select_list clamps to candidates)
            held = (nn + SIZE - 1) // SIZE
            nforced = tl.minimum(held, P) + tl.maximum(held - tl.maximum((nb - LOCAL) * P, P), 0)
            budget = row_budget_units(nb, density) * P
            tl.store(KK + b, tl.minimum(tl.maximum(budget - nforced, 0), K).to(tl.int32))

    @triton.jit
    def _select_kernel(X, N, OUT, SC, density,
                       SIZE: tl.constexpr, P: tl.constexpr, LOCAL: tl.constexpr, LSE: tl.constexpr,
                       DIV: tl.constexpr, TINY: tl.constexpr, WID: tl.constexpr, WP: tl.constexpr, K: tl.constexpr,
                       OUTW: tl.constexpr, OP: tl.constexpr, SCORES: tl.constexpr):
        b = tl.program_id(0)
        nn = tl.load(N + b)
        cols = tl.arange(0, WP)
        inside = cols < WID
        x = _finalise(tl.load(X + b * WID + cols, mask=inside, other=0.0), LSE, DIV, TINY)
        if SCORES:  # the fp32 scores ranked, for tests
            tl.store(SC + b * WID + cols, x, mask=inside)

        forced, cand, nb = _row_parts(nn, cols, inside, SIZE, P, LOCAL)
        budget = row_budget_units(nb, density) * P
        nforced = tl.sum(forced.to(tl.int32), 0)
        ncand = tl.sum(cand.to(tl.int32), 0)
        kk = tl.minimum(tl.minimum(tl.maximum(budget - nforced, 0), K), ncand)

        xz = tl.where(x == 0.0, 0.0, x)  # -0.0 ranks as 0.0
        bits = xz.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # float order as int order: every float above I32_MIN + 1
        key = tl.where(cand, key, tl.full([WP], -2147483648, tl.int32))  # below every candidate
        lo = kth_key(cand, key, kk, ncand)  # the bisection that stops at an exact count
        take, pos, total = take_at_threshold(cand, key, lo, kk, forced)
        tl.store(OUT + b * OUTW + pos, cols.to(tl.int32), mask=(take > 0) & (pos < OUTW))
        p = tl.arange(0, OP)
        tl.store(OUT + b * OUTW + p, tl.full([OP], -1, tl.int32), mask=(p < OUTW) & (p >= total))


def part_select(x: torch.Tensor, n: torch.Tensor, heads: str, num_heads: int, block: int, parts: int,
                local_blocks: int, density: float, top: int, out_width: int, out: torch.Tensor | None = None,
                scores: torch.Tensor | None = None, num_warps: int | None = None,
                wide_min: int = SINGLE_MAX + 1) -> torch.Tensor:
    """x [bsz, w * P] fp64: the heads' combined partial (``part_combine``'s, reduced over shards); n [bsz]
    int64 lengths (the new token included, at most w * block); ``heads`` "pair" / "pair-lse"; ``num_heads``
    the divisor of "pair" (the model's KV heads under tensor parallelism, else this shard's); ``top`` the
    static top width (``paired_constants``' ``p_k``), ``out_width`` the list width (``p_width``). Returns the
    ascending, -1 padded part lists [bsz, out_width] int32 (in ``out`` if given, contiguous); ``scores``
    [bsz, w * P] fp32, if given, receives the finalised scores ranked. Rows of at least ``wide_min`` parts
    take the multi-program path (``_mark_kernel`` + ``select_list``; the same lists)."""
    if heads not in HEADS:
        raise ValueError(f"part_select combines heads {HEADS}, got {heads!r}")
    bsz, width = x.shape
    if (x.dtype != torch.float64 or not x.is_contiguous() or n.shape != (bsz,) or n.dtype != torch.long
            or block % parts or width % parts or not 1 <= out_width <= width or top < 0 or num_heads < 1):
        raise ValueError("part_select needs x [bsz, w * P] fp64 contiguous, int64 lengths [bsz], P dividing the "
                         "block and the width, 1 <= out_width <= width")
    if out is None:
        out = torch.empty(bsz, out_width, dtype=torch.int32, device=x.device)
    if scores is not None and (scores.shape != x.shape or scores.dtype != torch.float32 or not scores.is_contiguous()):
        raise ValueError("scores must be [bsz, w * P] fp32 contiguous")
    dens = fp32_value(density)
    common = dict(SIZE=block // parts, P=parts, LOCAL=local_blocks, LSE=heads == "pair-lse", DIV=num_heads,
                  TINY=TINY64, WID=width, K=top, SCORES=scores is not None)
    if width >= wide_min:
        marked = torch.empty(bsz, width, dtype=torch.float32, device=x.device)
        kk = torch.empty(bsz, dtype=torch.int32, device=x.device)
        tile = min(1024, next_pow2(width))
        _mark_kernel[(bsz, -(-width // tile))](x, n, marked, kk, scores if scores is not None else x, dens,
                                               TP=tile, num_warps=4, **common)
        # past wide_min the radix path, whatever select_list's own one-program bound
        return select_list_triton(marked, kk, top, out_width, single_max=min(SINGLE_MAX, wide_min - 1), out=out)
    wp = 1 << max(width - 1, 0).bit_length()
    if num_warps is None:  # ~16-32 parts a thread
        num_warps = 4 if wp <= 1024 else 8 if wp <= 4096 else 16
    _select_kernel[(bsz,)](x, n, out, scores if scores is not None else x, dens, WP=wp, OUTW=out_width,
                           OP=1 << max(out_width - 1, 0).bit_length(), num_warps=num_warps, **common)
    return out
