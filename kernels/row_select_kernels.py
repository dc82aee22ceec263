"""The Triton kernels of ``row_select.py``'s list selection: its docstring has the contract and the
measurements, and its ``select_list_triton`` picks the path on the host and lays out the buffers. Candidates
are ranked by ``order_keys``'s 32-bit keys, computed here from the scores (``_keys``).

- ``single_kernel`` (rows of at most ``single_max`` columns): one program per row holds the row in registers
  and bisects the key range for the kk-th largest key (``part_select``'s search, forced / excluded by value
  here); everything above it, then the first ties in column order, are taken and written at ``tl.cumsum``
  positions. 1 launch.
- the radix path (longer rows), one program per (row, chunk) over one zeroed scratch buffer:

  1. ``hist_kernel`` level 1: each program counts its candidates by the key's top 8 bits (sign and 7
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
  4. ``write_kernel``: each program counts its chunk's forced + above-T entries and its ties at T, publishes
     both, and sums its row's earlier chunks' counts as they appear (a decoupled look-back: programs take
     chunks in the order of an atomic ticket, so a program only ever waits on chunks already running and the
     wait cannot deadlock); its ties before the row's t-th and its takes then go to their ascending output
     positions. The same program writes the -1 padding of its share of the row's tail.

Triton is optional (``common``'s guarded import): without it this module defines only the scratch layout's
widths, and nothing here is launched.
"""

from __future__ import annotations

from .common import kth_key, take_at_threshold, tl, triton

STATE_W = 8  # per-row state words (see hist_kernel)
CNT_W = 4  # per-row arrival counters (one per level)


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
    def single_kernel(S, KK, OUT, N, K_MAX, OUTW, NP: tl.constexpr, PB: tl.constexpr):
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
    def hist_kernel(S, KK, HIST, CNT, STATE, N, C, K_MAX, HROW,
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
    def write_kernel(S, STATE, LOOK, TICKET, OUT, N, C, OUTW, PADW,
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

