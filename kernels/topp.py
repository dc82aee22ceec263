"""SpecAttn's sorting-free top-p (``scorer_reference.topp_mask_reference``) without a sort and in few passes.

The reference bisects a threshold over [0, max(a)] for a fixed number of iterations, one pass over the
row per iteration. The bisection is a walk down a binary tree whose node thresholds depend only on the
path (mid = (lo + hi) * 0.5 in fp32, exactly the reference's arithmetic), so a pass can evaluate the
masses {a >= t} of all 2**K - 1 nodes of the next K levels at once and the walk then descends K levels:
10 iterations take 3 mass passes (K = 4, 4, 2) instead of 10. The result is the reference's, up to the
order of the fp32 sums (a decision flips only where a mass equals the target to rounding).

Every pass is spread over ``splits`` programs per row, each writing partial sums, and every program
replays the descent from all earlier passes' partials (a few hundred loads), so no state is written
between launches and nothing is read back to the host: 5 launches (stats, 3 mass passes, mask) for
any length, CUDA-graph capturable. Slot 15 of the first mass pass holds the mass at max(a), the
reference's check that the (tied) maxima alone reach the target.
"""

from __future__ import annotations

import torch

from .common import next_pow2, tl, triton

LEVELS = 4  # tree levels per pass: 15 node thresholds (+ the max) in 16 slots
_TILE = 256  # elements per step
_MIN_PER_SPLIT = 4096


if triton is not None:

    @triton.jit
    def _replay(PMAX, PSUM, PMASS, row, rows, splits, p, N_PASS: tl.constexpr, ITERS: tl.constexpr,
                S_PAD: tl.constexpr, LEV: tl.constexpr):
        """(lo, hi, mx, top_ok) after the first ``N_PASS`` mass passes (their partials in PMASS)."""
        s = tl.arange(0, S_PAD)
        s_ok = s < splits
        mx = tl.max(tl.load(PMAX + row * splits + s, mask=s_ok, other=0.0), 0)
        target = p * tl.sum(tl.load(PSUM + row * splits + s, mask=s_ok, other=0.0), 0)
        lo = tl.zeros((), dtype=tl.float32)
        hi = mx
        top_ok = tl.zeros((), dtype=tl.int1)
        slot = tl.arange(0, 16)
        for j in tl.static_range(N_PASS):
            part = tl.load(PMASS + ((j * rows + row) * splits + s)[:, None] * 16 + slot[None, :],
                           mask=s_ok[:, None], other=0.0)
            mass = tl.sum(part, 0)  # [16]
            if j == 0:
                top_ok = tl.sum(tl.where(slot == 15, mass, 0.0), 0) >= target
            node = tl.zeros((), dtype=tl.int32)
            for lev in tl.static_range(LEV):
                if j * LEV + lev < ITERS:
                    mid = (lo + hi) * 0.5
                    ok = tl.sum(tl.where(slot == node, mass, 0.0), 0) >= target
                    lo = tl.where(ok, mid, lo)
                    hi = tl.where(ok, hi, mid)
                    node = 2 * node + 1 + ok.to(tl.int32)
        return lo, hi, mx, top_ok

    @triton.jit
    def _node_thresholds(lo, hi, mx, LEV: tl.constexpr):
        """fp32 [16]: slot i < 15 the threshold of heap node i (root 0, children 2i+1 below, 2i+2 above) of
        the next LEV levels from (lo, hi), by the reference's own arithmetic; slot 15 = mx."""
        v = tl.arange(0, 16) + 1  # 1-based heap index: the bits below the leading 1 spell the path
        depth = tl.zeros([16], dtype=tl.int32)
        for i in tl.static_range(1, LEV):
            depth += (v >= (1 << i)).to(tl.int32)
        nlo = tl.zeros([16], dtype=tl.float32) + lo
        nhi = tl.zeros([16], dtype=tl.float32) + hi
        for t in tl.static_range(LEV - 1):
            active = t < depth
            bit = (v >> tl.maximum(depth - 1 - t, 0)) & 1
            mid = (nlo + nhi) * 0.5
            nlo = tl.where(active & (bit == 1), mid, nlo)
            nhi = tl.where(active & (bit == 0), mid, nhi)
        return tl.where(v == 16, mx, (nlo + nhi) * 0.5)

    @triton.jit
    def _stats_kernel(A, PMAX, PSUM, n, stride_a, per_split, TILE: tl.constexpr):
        split = tl.program_id(0)
        row = tl.program_id(1)
        base = A + row.to(tl.int64) * stride_a
        mx = tl.zeros([TILE], dtype=tl.float32)
        sm = tl.zeros([TILE], dtype=tl.float32)
        e0 = split * per_split
        for c in range(e0, tl.minimum(e0 + per_split, n), TILE):
            e = c + tl.arange(0, TILE)
            a = tl.load(base + e, mask=e < n, other=0.0)
            mx = tl.maximum(mx, a)
            sm += a
        out = row * tl.num_programs(0) + split
        tl.store(PMAX + out, tl.max(mx, 0))
        tl.store(PSUM + out, tl.sum(sm, 0))

    @triton.jit
    def _mass_kernel(A, PMAX, PSUM, PMASS, n, stride_a, per_split, p, PASS: tl.constexpr, ITERS: tl.constexpr,
                     TILE: tl.constexpr, S_PAD: tl.constexpr, LEV: tl.constexpr):
        split = tl.program_id(0)
        row = tl.program_id(1)
        splits = tl.num_programs(0)
        rows = tl.num_programs(1)
        lo, hi, mx, top_ok = _replay(PMAX, PSUM, PMASS, row, rows, splits, p, PASS, ITERS, S_PAD, LEV)
        thr = _node_thresholds(lo, hi, mx, LEV)
        base = A + row.to(tl.int64) * stride_a
        mass = tl.zeros([TILE, 16], dtype=tl.float32)
        e0 = split * per_split
        for c in range(e0, tl.minimum(e0 + per_split, n), TILE):
            e = c + tl.arange(0, TILE)
            a = tl.load(base + e, mask=e < n, other=0.0)
            mass += tl.where(a[:, None] >= thr[None, :], a[:, None], 0.0)
        slot = tl.arange(0, 16)
        tl.store(PMASS + ((PASS * rows + row) * splits + split) * 16 + slot, tl.sum(mass, 0))

    @triton.jit
    def _mask_kernel(A, Mask, PMAX, PSUM, PMASS, n, stride_a, stride_m, per_split, p, N_PASS: tl.constexpr,
                     ITERS: tl.constexpr, TILE: tl.constexpr, S_PAD: tl.constexpr, LEV: tl.constexpr):
        split = tl.program_id(0)
        row = tl.program_id(1)
        lo, hi, mx, top_ok = _replay(PMAX, PSUM, PMASS, row, tl.num_programs(1), tl.num_programs(0), p, N_PASS,
                                     ITERS, S_PAD, LEV)
        lo = tl.where(top_ok, mx, lo)
        base = A + row.to(tl.int64) * stride_a
        e0 = split * per_split
        for c in range(e0, tl.minimum(e0 + per_split, n), TILE):
            e = c + tl.arange(0, TILE)
            a = tl.load(base + e, mask=e < n, other=0.0)
            tl.store(Mask + row.to(tl.int64) * stride_m + e, ((a >= lo) & (a > 0)).to(tl.int8), mask=e < n)


def _splits(rows: int, n: int, device: torch.device) -> tuple[int, int]:
    """(splits per row, elements per split) from shapes only: about 4 programs per SM, at least
    ``_MIN_PER_SPLIT`` elements each, at most 64 splits."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    return _split_sizes(n, max(1, min(64, -(-4 * sms // max(1, rows)), -(-n // _MIN_PER_SPLIT))))


def _split_sizes(n: int, want: int) -> tuple[int, int]:
    """(splits, elements per split) for about ``want`` splits of whole tiles."""
    per = -(-n // max(1, min(want, 64)))
    per = -(-per // _TILE) * _TILE
    return -(-n // per), per


def topp_mask(a: torch.Tensor, p: float, iters: int, splits: int | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask [..., n] of ``scorer_reference.topp_mask_reference`` for 0 < p < 1 (non-negative a).
    ``splits`` pins the programs per row (default: from shapes); ``out``: an int8 [rows, n] buffer."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    lead, n = a.shape[:-1], a.shape[-1]
    a2 = a.reshape(-1, n).float()
    if a2.stride(-1) != 1:
        a2 = a2.contiguous()
    rows = a2.shape[0]
    mask = torch.empty(rows, n, dtype=torch.int8, device=a.device) if out is None else out
    if rows and n:
        if splits is None:
            splits, per = _splits(rows, n, a.device)
        else:
            splits, per = _split_sizes(n, splits)
        passes = max(1, -(-iters // LEVELS))  # one at least: the top check reads the first pass's slot 15
        f32 = dict(dtype=torch.float32, device=a.device)
        pmax, psum = torch.empty(rows, splits, **f32), torch.empty(rows, splits, **f32)
        pmass = torch.empty(passes, rows, splits, 16, **f32)
        meta = dict(ITERS=iters, TILE=_TILE, S_PAD=next_pow2(splits), LEV=LEVELS, num_warps=4)
        grid = (splits, rows)
        _stats_kernel[grid](a2, pmax, psum, n, a2.stride(0), per, TILE=_TILE, num_warps=4)
        for j in range(passes):
            _mass_kernel[grid](a2, pmax, psum, pmass, n, a2.stride(0), per, p, PASS=j, **meta)
        _mask_kernel[grid](a2, mask, pmax, psum, pmass, n, a2.stride(0), mask.stride(0), per, p, N_PASS=passes,
                           **meta)
    return mask.view(torch.bool).view(*lead, n)
