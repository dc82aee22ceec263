"""Exact top-k *list* selection per row for the sparse-attention decode path, CUDA-graph capturable.

``select_list(score, kk, k_max, out_width)``: ``score`` fp32 [R, N] contiguous, where +inf marks a forced
entry (always listed), -inf an excluded one (never) and any finite value a candidate; ``kk`` [R] (int32 or
int64, on the device) how many candidates each row picks, clamped to [0, k_max] and to the row's candidates.
Returns int32 [R, out_width]: per row the ascending columns of the forced entries and of the kk best
candidates by (score descending, column ascending) -- a stable descending sort's first kk, -0.0 ranking as
0.0 -- padded with -1 and truncated to ``out_width``.

Candidates are ranked by their 32-bit order-preserving keys (``order_keys``: the fp32 bits with the low 31
flipped on negatives, so int32 order is float order). Nothing reads the device from the host and every
grid and buffer comes from shapes alone, so a call can be captured in a CUDA graph. Two Triton paths, picked
by N on the host:

- ``N <= single_max`` (8192): ``_single_kernel``, one program per row, holds the row in registers and bisects
  the key range for the kk-th largest key (``part_select``'s search, forced / excluded by value here);
  everything above it, then the first ties in column order, are taken and written at ``tl.cumsum``
  positions. 1 launch.
- larger rows: each row is cut into C chunks, one program per (row, chunk), R * C programs per launch
  (C from a ~1024-program target), over one zeroed scratch buffer (1 memset):

  1. ``_hist_kernel`` level 1: each program counts its candidates by the key's top 8 bits (sign and 7
     exponent bits) with ``tl.histogram`` and adds the non-empty bins to the row's histogram, and its forced
     count to the row's total. The row's last program to arrive (an arrival counter after a CTA barrier)
     scans the histogram's suffix sums for the bucket holding the kk-th largest key and leaves (kk, bucket,
     how many still to pick in it) in the row's state. (One global atomic per candidate into 11-bit buckets
     instead, the first design, serialised on the few hot buckets real scores fall into: 1.45x slower at
     R = 8, N = 131072 on the H100);
  2. level 2: the next 12 bits of the keys inside that bucket, one global atomic per key (a chunk whose
     keys share one digit -- runs of ties -- adds once);
  3. level 3: the last 12 bits: the exact threshold key T and how many of its ties t are taken. A level
     whose bucket is taken whole ends the search early (T is the bucket's lowest key, every tie taken), and
     the later levels count nothing;
  4. ``_write_kernel``: each program counts its chunk's forced + above-T entries and its ties at T, publishes
     both, and sums its row's earlier chunks' counts as they appear (a decoupled look-back: programs take
     chunks in the order of an atomic ticket, so a program only ever waits on chunks already running and the
     wait cannot deadlock); its ties before the row's t-th and its takes then go to their ascending output
     positions. The same program writes the -1 padding of its share of the row's tail.

  4 launches plus the memset; the scores are read once per launch (from L2 after the first).

Measured on an H100 (CUDA graph replay, L2 flushed, ``benchmarks/bench_row_select.py``): R = 8, N = 131072,
k = 13107: 44 us (``select_list_torch`` 580 us, a bare ``torch.topk`` 159 us); R = 64, N = 65536, k = 6554:
97 us (topk 211 us); R = 8, N = 8192, k = 820: 19-21 us on the one-program path, 22.5 us on the radix path.
Each radix launch costs ~4 us at small sizes (launch, the arrival, the last program's scan) and ~9 / ~20 us
per histogram level at 1M / 4M scores; the write launch 11 / 29 us.

``select_list_torch`` is the PyTorch form (the CPU path and the tests' oracle): int64 keys (order key,
~column), one ``torch.topk`` of k_max, a scatter and a cumsum; exact, ties included.
"""

from __future__ import annotations

import torch

from .common import kth_key, next_pow2, take_at_threshold, tl, triton
from .dispatch import triton_wanted

SINGLE_MAX = 8192  # largest row the one-program path holds in registers
BITS = (8, 12, 12)  # the key's bits per radix level (level 1 by tl.histogram: its cost grows with the bins)
STATE_W = 8  # per-row state words (see _hist_kernel)
CNT_W = 4  # per-row arrival counters (one per level)
TARGET_PROGRAMS = 1024  # chunk size aims at ~8 programs per SM on a 132-SM GPU


def order_keys(score: torch.Tensor) -> torch.Tensor:
    """int32 keys whose signed order is the fp32 order of ``score`` (-0.0 as 0.0)."""
    b = torch.where(score == 0, torch.zeros_like(score), score).contiguous().view(torch.int32)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


def _check(score: torch.Tensor, kk: torch.Tensor, k_max: int, out_width: int) -> None:
    if score.dim() != 2 or score.dtype != torch.float32 or not score.is_contiguous():
        raise ValueError("select_list needs score [R, N] fp32 contiguous")
    if kk.shape != (score.shape[0],) or kk.dtype not in (torch.int32, torch.int64):
        raise ValueError("select_list needs kk [R] int32 or int64")
    if k_max < 0 or out_width < 0:
        raise ValueError("k_max and out_width must be >= 0")


def select_list_torch(score: torch.Tensor, kk: torch.Tensor, k_max: int, out_width: int) -> torch.Tensor:
    """The PyTorch form of ``select_list`` (same contract); device ops from shapes only, so capturable too."""
    _check(score, kk, k_max, out_width)
    rows, n = score.shape
    dev = score.device
    out = torch.full((rows, out_width + 1), -1, dtype=torch.int32, device=dev)
    if rows == 0 or n == 0:
        return out[:, :out_width].contiguous()
    forced = score == float("inf")
    cand = torch.isfinite(score)
    col = torch.arange(n, device=dev)
    # (order key, ~column): distinct per row, so topk's order is exactly the stable descending sort's.
    key = (order_keys(score).long() << 32) + (0xFFFFFFFF - col)
    key = torch.where(cand, key, torch.iinfo(torch.int64).min)
    kk_eff = torch.minimum(kk.long().clamp(0, k_max), cand.sum(1))
    take = forced.clone()
    m = min(k_max, n)
    if m > 0:
        idx = torch.topk(key, m, dim=1, sorted=True).indices
        ranked = torch.arange(m, device=dev)[None, :] < kk_eff[:, None]
        take.scatter_(1, idx, ranked | take.gather(1, idx))
    pos = take.long().cumsum(1) - 1
    # Entries not taken (or past the width) land in the spare last column, dropped below.
    dst = torch.where(take & (pos < out_width), pos, out_width)
    out.scatter_(1, dst, col.to(torch.int32).expand(rows, n).contiguous())
    out[:, out_width] = -1
    return out[:, :out_width].contiguous()


if triton is not None:

    @triton.jit
    def _keys(x):
        xz = tl.where(x == 0.0, 0.0, x)  # -0.0 ranks as 0.0
        bits = xz.to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _row_kk(KK, r, ncand, K_MAX):
        kk = tl.load(KK + r).to(tl.int64)
        kk = tl.minimum(tl.maximum(kk, 0), K_MAX)
        return tl.minimum(kk, ncand.to(tl.int64)).to(tl.int32)

    @triton.jit
    def _single_kernel(S, KK, OUT, N, K_MAX, OUTW, NP: tl.constexpr, PB: tl.constexpr):
        r = tl.program_id(0)
        cols = tl.arange(0, NP)
        x = tl.load(S + r.to(tl.int64) * N + cols, mask=cols < N, other=float("-inf"))
        forced = x == float("inf")
        cand = (x != float("-inf")) & ~forced
        key = tl.where(cand, _keys(x), -2147483648)  # below every candidate (-inf's key is above I32_MIN)
        ncand = tl.sum(cand.to(tl.int32), 0)
        kk = _row_kk(KK, r, ncand, K_MAX)
        lo = kth_key(cand, key, kk, ncand)
        take, pos, total = take_at_threshold(cand, key, lo.to(tl.int32), kk, forced)
        row = OUT + r.to(tl.int64) * OUTW
        tl.store(row + pos, cols.to(tl.int32), mask=(take > 0) & (pos < OUTW))
        for p0 in range(0, OUTW, PB):
            p = p0 + tl.arange(0, PB)
            tl.store(row + p, tl.full([PB], -1, tl.int32), mask=(p < OUTW) & (p >= total))

    @triton.jit
    def _hist_kernel(S, KK, HIST, CNT, STATE, N, C, K_MAX, HROW,
                     LEVEL: tl.constexpr, CHUNK: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr,
                     B3: tl.constexpr, LOCAL: tl.constexpr):
        """One radix level over (row, chunk) programs; the key's unsigned form is cut into B1 + B2 + B3 = 32
        bits. The row's state words: 0 kk, 1 forced + kk (the list's length; level 1 sums the forced counts
        into it first), 2 the bucket prefix the next level matches (-1 once the threshold is known), 3 how many
        are still to pick inside it, 4 the threshold key T, 5 the ties at T taken, 6 done. ``LOCAL``: level 1
        counts its chunk with ``tl.histogram`` (ballots: no two lanes contend) and adds only its non-empty
        bins, instead of one global atomic per candidate, which serialises on the few hot buckets that
        real scores' top bits (sign and exponent) fall into."""
        pid = tl.program_id(0)
        r = pid // C
        c = pid % C
        cols = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(S + r.to(tl.int64) * N + cols, mask=cols < N, other=float("-inf"))
        forced = x == float("inf")
        cand = (x != float("-inf")) & ~forced
        key = _keys(x)
        # the top B1 bits with the sign flipped: the unsigned key's order
        d1 = ((key >> (32 - B1)) & ((1 << B1) - 1)) ^ (1 << (B1 - 1))
        d2 = (key >> B3) & ((1 << B2) - 1)
        st = STATE + r * 8
        if LEVEL == 1:
            nbins: tl.constexpr = 1 << B1
            h = HIST + r * HROW
            digit = d1
            m = cand
            nf = tl.sum(forced.to(tl.int32), 0)
            tl.atomic_add(st + 1, nf, mask=nf > 0, sem="relaxed")
        elif LEVEL == 2:
            nbins: tl.constexpr = 1 << B2
            h = HIST + r * HROW + (1 << B1)
            digit = d2
            m = cand & (d1 == tl.load(st + 2))
        else:
            nbins: tl.constexpr = 1 << B3
            h = HIST + r * HROW + (1 << B1) + (1 << B2)
            digit = key & ((1 << B3) - 1)
            m = cand & (((d1 << B2) | d2) == tl.load(st + 2))
        if LOCAL and LEVEL == 1:
            hc = tl.histogram(digit, nbins, mask=m)
            hb = tl.arange(0, nbins)
            tl.atomic_add(h + hb, hc, mask=hc > 0, sem="relaxed")
        else:
            # A chunk whose counted keys share one digit (runs of exact ties) adds once: its lanes would
            # otherwise all hit one address.
            dmin = tl.min(tl.where(m, digit, 1 << 30), 0)
            dmax = tl.max(tl.where(m, digit, -1), 0)
            if dmin == dmax:
                tl.atomic_add(h + dmin, tl.sum(m.to(tl.int32), 0), sem="relaxed")
            else:
                tl.atomic_add(h + digit, 1, mask=m, sem="relaxed")
        # Every thread's adds precede the arrival (the barrier), and the arrival releases them to the last
        # program, whose acquire makes the whole histogram visible to it.
        tl.debug_barrier()
        old = tl.atomic_add(CNT + r * 4 + (LEVEL - 1), 1, sem="acq_rel")
        if old == C - 1:
            bins = tl.arange(0, nbins)
            hv = tl.load(h + bins, cache_modifier=".cg")  # L2, where the atomics landed
            if LEVEL == 1:
                kk = _row_kk(KK, r, tl.sum(hv, 0), K_MAX)
                tl.atomic_add(st + 1, kk, sem="relaxed")  # the forced counts already summed there
                tl.store(st, kk)
                rem = kk
                prefix = 0
                live = kk > 0
                if kk == 0:  # nothing to pick: no candidate key reaches T
                    tl.store(st + 2, -1)
                    tl.store(st + 4, 2147483647)
                    tl.store(st + 5, 0)
                    tl.store(st + 6, 1)
            else:
                rem = tl.load(st + 3)
                prefix = tl.load(st + 2)
                live = tl.load(st + 6) == 0
            if live:
                incl = tl.sum(hv, 0) - tl.cumsum(hv, 0) + hv  # keys in this bucket or above
                b = tl.sum((incl >= rem).to(tl.int32), 0) - 1  # the bucket holding the rem-th largest
                above = tl.sum(tl.where(bins > b, hv, 0), 0)
                nb = tl.sum(tl.where(bins == b, hv, 0), 0)
                rem = rem - above
                sign: tl.constexpr = 1 << (B1 - 1)
                if LEVEL == 1:
                    nxt = b
                    low = (b ^ sign) << (32 - B1)  # the bucket's lowest key
                elif LEVEL == 2:
                    nxt = (prefix << B2) | b
                    low = ((prefix ^ sign) << (32 - B1)) | (b << B3)
                else:
                    nxt = -1
                    low = (((prefix >> B2) ^ sign) << (32 - B1)) | ((prefix & ((1 << B2) - 1)) << B3) | b
                if (rem == nb) | (LEVEL == 3):  # taken whole (ties included), or the exact key
                    tl.store(st + 2, -1)
                    tl.store(st + 4, low)
                    tl.store(st + 5, rem)
                    tl.store(st + 6, 1)
                else:
                    tl.store(st + 2, nxt)
                    tl.store(st + 3, rem)

    @triton.jit
    def _write_kernel(S, STATE, LOOK, TICKET, OUT, N, C, OUTW, PADW,
                      CHUNK: tl.constexpr, CP: tl.constexpr, PB: tl.constexpr):
        g = tl.atomic_add(TICKET, 1, sem="relaxed")  # chunks in arrival order: waits only on running ones
        r = g // C
        c = g % C
        st = STATE + r * 8
        total = tl.load(st + 1)
        thr = tl.load(st + 4)
        t = tl.load(st + 5)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(S + r.to(tl.int64) * N + cols, mask=cols < N, other=float("-inf"))
        forced = x == float("inf")
        cand = (x != float("-inf")) & ~forced
        key = _keys(x)
        gt = forced | (cand & (key > thr))
        eq = cand & (key == thr)
        ng = tl.sum(gt.to(tl.int32), 0)
        ne = tl.sum(eq.to(tl.int32), 0)
        # Published as one word, (takes above T) << 32 | (ties + 1): nonzero once written.
        tl.atomic_xchg(LOOK + g, (ng.to(tl.int64) << 32) | (ne + 1).to(tl.int64), sem="release")
        row = OUT + r.to(tl.int64) * OUTW
        # This chunk's share of the row's -1 tail needs only the list's length: written before the wait.
        for p0 in range(0, PADW, PB):
            q = p0 + tl.arange(0, PB)
            p = c * PADW + q
            tl.store(row + p, tl.full([PB], -1, tl.int32), mask=(q < PADW) & (p < OUTW) & (p >= total))
        prev = tl.arange(0, CP)
        pm = prev < c
        v = tl.load(LOOK + r * C + prev, mask=pm, other=1, volatile=True)
        while tl.min(tl.where(pm, v & 0x7FFFFFFF, 1), 0) == 0:
            v = tl.load(LOOK + r * C + prev, mask=pm, other=1, volatile=True)
        sv = tl.sum(tl.where(pm, v, 0), 0)
        f_before = (sv >> 32).to(tl.int32)
        e_before = (sv - ((sv >> 32) << 32)).to(tl.int32) - c
        take = gt | (eq & (e_before + tl.cumsum(eq.to(tl.int32), 0) <= t))
        pos = f_before + tl.minimum(e_before, t) + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(row + pos, cols.to(tl.int32), mask=take & (pos < OUTW))


def default_chunk(rows: int, n: int) -> int:
    """Columns per program of the multi-program path: ~TARGET_PROGRAMS programs, 1024 to 8192 columns."""
    want = next_pow2(max(1, -(-rows * n // TARGET_PROGRAMS)))
    return max(1024, min(8192, want, next_pow2(n)))


def select_list_triton(score: torch.Tensor, kk: torch.Tensor, k_max: int, out_width: int, *,
                       single_max: int = SINGLE_MAX, chunk: int | None = None, num_warps: int | None = None,
                       bits: tuple[int, int, int] = BITS, local_hist: bool = True,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """``select_list`` on Triton. Rows of at most ``single_max`` columns take the one-program path, longer
    ones the multi-program path with ``chunk`` columns (a power of two >= 16) per program. ``out``, if given,
    receives the lists (int32 [R, out_width] contiguous; every element is written). ``bits`` (summing to 32,
    each 5 to 14) and ``local_hist`` (level 1 by ``tl.histogram``) choose the radix levels, for benchmarks."""
    _check(score, kk, k_max, out_width)
    # The kernels read kk[r] at offset r: a broadcast view (an expanded [B, 1] flattened at B = 1 has stride 0)
    # would hand every row past the first whatever lies beyond it.
    kk = kk.contiguous()
    rows, n = score.shape
    dev = score.device
    if out is None:
        out = torch.empty(rows, out_width, dtype=torch.int32, device=dev)
    elif out.shape != (rows, out_width) or out.dtype != torch.int32 or not out.is_contiguous():
        raise ValueError("out must be [R, out_width] int32 contiguous")
    if rows == 0 or out_width == 0:
        return out
    if n == 0:
        return out.fill_(-1)
    pb = min(1024, next_pow2(out_width))
    if n <= single_max:
        np_ = next_pow2(n)
        warps = num_warps or (4 if np_ <= 1024 else 8)  # 8 beat 16 at 8192 columns on the H100
        _single_kernel[(rows,)](score, kk, out, n, k_max, out_width, NP=np_, PB=pb, num_warps=warps)
        return out
    chunk = chunk or default_chunk(rows, n)
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    c = -(-n // chunk)
    warps = num_warps or (4 if chunk <= 2048 else 8)
    # One zeroed buffer (one memset): the look-back words (int64), then histograms, arrival counters,
    # row states and the ticket (int32).
    if sum(bits) != 32 or not all(5 <= b <= 14 for b in bits):
        raise ValueError(f"bits must be three widths of 5 to 14 summing to 32, got {bits}")
    hrow = sum(1 << b for b in bits)  # the row's three histograms
    n32 = rows * (hrow + CNT_W + STATE_W) + 2
    scratch = torch.zeros(rows * c + n32 // 2, dtype=torch.int64, device=dev)
    look = scratch[: rows * c]
    i32 = scratch[rows * c:].view(torch.int32)
    hist = i32[: rows * hrow]
    cnt = i32[rows * hrow: rows * (hrow + CNT_W)]
    state = i32[rows * (hrow + CNT_W): rows * (hrow + CNT_W + STATE_W)]
    ticket = i32[rows * (hrow + CNT_W + STATE_W):]
    grid = (rows * c,)
    for level in (1, 2, 3):
        _hist_kernel[grid](score, kk, hist, cnt, state, n, c, k_max, hrow, LEVEL=level, CHUNK=chunk, B1=bits[0],
                           B2=bits[1], B3=bits[2], LOCAL=local_hist, num_warps=warps)
    padw = -(-out_width // c)
    _write_kernel[grid](score, state, look, ticket, out, n, c, out_width, padw, CHUNK=chunk, CP=next_pow2(c),
                        PB=min(pb, next_pow2(padw)), num_warps=warps)
    return out


def select_list(score: torch.Tensor, kk: torch.Tensor, k_max: int, out_width: int) -> torch.Tensor:
    """Ascending forced + top-kk column lists [R, out_width] int32, -1 padded (see the module docstring):
    Triton on CUDA tensors (or when ``RAYSPARSE_KERNELS=triton``), else the PyTorch form."""
    if triton_wanted(score, kk):
        return select_list_triton(score, kk, k_max, out_width)
    return select_list_torch(score, kk, k_max, out_width)
