"""SOCKET's kernels: SimHash bucketing of keys and the soft-collision scorer (reference: ``scorer_reference``).

Bucketing: ``w [h, L, P, d]`` hyperplanes, ``x [h, m, d]`` keys -> ids ``[h, L, m]``, bit p of a table's id set
iff (W_l x)_p > 0 (little-endian, an exact 0 counts as negative). One program takes ``BLOCK_M`` keys of one head
and a group of tables whose planes fill 64 columns: one ``[BLOCK_M, d] x [d, 64]`` product in fp32 on tensor
cores, as bf16 products for bf16 keys (the planes split in three bf16 pieces, one where bf16 holds the planes
exactly, as SOCKET draws them) and as 3xTF32 otherwise (both about 1e-6 relative or better, as exact fp32 sums
differ among themselves; plain TF32 would flip the sign of many near-zero projections against the reference, and
exact fp32 on CUDA cores took 10 ms a layer to hash a 32K-token prompt on an H200), then the sign bits are
packed and stored in the output's dtype (int32 like the reference, or the uint8 / int16 of the cache). The same
call hashes a whole prompt at prefill and the few keys appended by a decode step.

Scoring: ``score_j = sum_l probs[l, bucket_l(j)]`` (times ``||v_j||`` when norms are given) over a ragged
batch: ``buckets [h, L, total]`` / ``norms [h, total]`` packed along tokens by ``cu_seqlens``, ``probs
[batch, h, L, R]``. One program takes ``BLOCK_N`` keys of one head and sequence and streams their L bucket
ids, gathering each table's probability from the (cache-resident) ``[L, R]`` table; it never reads a key.
"""

from __future__ import annotations

import torch

from .common import interpreting, next_pow2, tl, triton

_HASH_ROWS = 128  # keys per bucketing program (64: 0.33 ms against 0.28 for a 32K-token prompt on an H200)
_HASH_COLS = 64  # projections per bucketing program (tables x padded planes)
_SCORE_KEYS = 512  # keys per scoring program


if triton is not None:

    @triton.jit
    def _bucket_kernel(X, W, Out, PG, OFF, m, planes, tables, stride_xp, stride_xh, stride_xm, stride_wh,
                       stride_wl, stride_wp, stride_op, stride_oh, stride_ol, BLOCK_M: tl.constexpr,
                       HEAD_DIM: tl.constexpr, P_PAD: tl.constexpr, GROUP: tl.constexpr, PRECISION: tl.constexpr,
                       SPLIT: tl.constexpr, SLOTS: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        h = tl.program_id(1).to(tl.int64)
        ok = rows < m
        if SLOTS:  # row i is cache slot (PG[i], OFF[i]) of a paged pool, read and written in place
            pg = tl.load(PG + rows, mask=ok, other=0).to(tl.int64)
            pos = tl.load(OFF + rows, mask=ok, other=0).to(tl.int64)
        else:
            pg = tl.zeros([BLOCK_M], dtype=tl.int64)
            pos = rows.to(tl.int64)
        d = tl.arange(0, HEAD_DIM)
        x = tl.load(X + (pg * stride_xp + pos * stride_xm)[:, None] + h * stride_xh + d[None, :],
                    mask=ok[:, None], other=0.0)
        col = tl.arange(0, GROUP * P_PAD)
        t0 = tl.program_id(2) * GROUP  # this program's GROUP tables, side by side in one product
        t = t0 + col // P_PAD
        p = col % P_PAD
        live = (p < planes) & (t < tables)
        w = tl.load(W + h * stride_wh + t[:, None] * stride_wl + p[:, None] * stride_wp + d[None, :],
                    mask=live[:, None], other=0.0)
        if SPLIT:
            # bf16 keys are exact operands; the fp32 planes split into bf16 pieces (8 + 8 + 8 bits of mantissa)
            # whose exact products sum in the fp32 accumulator, smallest first: the fp32 projection to about
            # 1e-7 relative, on bf16 tensor cores. Planes that bf16 holds exactly (SOCKET draws them so:
            # ``lsh.hyperplanes``) have no second or third piece and take one product.
            w1 = w.to(tl.bfloat16)
            rest = w - w1.to(tl.float32)
            proj = tl.zeros([BLOCK_M, GROUP * P_PAD], dtype=tl.float32)
            if tl.max(tl.max(tl.abs(rest), 1), 0) > 0.0:
                w2 = rest.to(tl.bfloat16)
                w3 = (rest - w2.to(tl.float32)).to(tl.bfloat16)
                proj = tl.dot(x, tl.trans(w3), proj, out_dtype=tl.float32)
                proj = tl.dot(x, tl.trans(w2), proj, out_dtype=tl.float32)
            proj = tl.dot(x, tl.trans(w1), proj, out_dtype=tl.float32)  # [BLOCK_M, GROUP * P_PAD]
        else:
            proj = tl.dot(x.to(tl.float32), tl.trans(w), input_precision=PRECISION)  # [BLOCK_M, GROUP * P_PAD]
        bits = tl.where((proj > 0) & live[None, :], (1 << p)[None, :], 0)
        ids = tl.sum(tl.reshape(bits, (BLOCK_M, GROUP, P_PAD)), 2)  # [BLOCK_M, GROUP]
        g = tl.arange(0, GROUP)
        out = Out + (pg * stride_op + pos)[:, None] + h * stride_oh + (t0 + g)[None, :] * stride_ol
        tl.store(out, ids.to(Out.dtype.element_ty), mask=ok[:, None] & ((t0 + g) < tables)[None, :])

    @triton.jit
    def _collision_kernel(P, B, NORM, Out, CU, tables, stride_pb, stride_ph, stride_pl, stride_bh, stride_bl,
                          stride_nh, stride_oh, BLOCK_N: tl.constexpr, HAS_NORM: tl.constexpr):
        nb = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        seq = tl.program_id(2)
        t0 = tl.load(CU + seq)
        n = tl.load(CU + seq + 1) - t0
        if nb * BLOCK_N < n:
            j = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = j < n
            tok = (t0 + j).to(tl.int64)
            prob_row = P + seq.to(tl.int64) * stride_pb + h * stride_ph
            ids_row = B + h * stride_bh + tok
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for t in range(tables):
                ids = tl.load(ids_row + t * stride_bl, mask=ok, other=0).to(tl.int32)
                acc += tl.load(prob_row + t * stride_pl + ids, mask=ok, other=0.0)
            if HAS_NORM:
                acc *= tl.load(NORM + h * stride_nh + tok, mask=ok, other=0.0)
            tl.store(Out + h * stride_oh + tok, acc, mask=ok)


def bucket_ids(w: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype = torch.int32,
               out: torch.Tensor | None = None, precision: str | None = None,
               block_m: int | None = None) -> torch.Tensor:
    """w: [h, L, P, d], x: [h, m, d] -> bucket ids [h, L, m] in ``out_dtype`` (or written into ``out``).
    ``precision``: the projections' dot: "bf16x3" (bf16 keys only), "tf32x3", "tf32" or "ieee"; None: bf16x3
    for bf16 keys and 3xTF32 for others on GPUs, exact fp32 in the interpreter (whose bf16 dot is not exact).
    ``block_m``: keys per program (``_launch_buckets``)."""
    h, m = x.shape[0], x.shape[1]
    out = torch.empty(h, w.shape[1], m, dtype=out_dtype, device=x.device) if out is None else out
    if out.stride(-1) != 1:
        raise ValueError("out needs a contiguous token dimension")
    x = x if x.stride(-1) == 1 else x.contiguous()
    _launch_buckets(w, x[None], out[None], None, None, m, precision, block_m)
    return out


def bucket_ids_into_slots(w: torch.Tensor, keys: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor,
                          ids: torch.Tensor, precision: str | None = None) -> None:
    """Hashes cache slots in place: keys ``[pages, h, page, d]`` (a layer's paged K), slots (``pages[i]``,
    ``offsets[i]``) ``[T]`` -> their ids written to ``ids [pages, h, L, page]``. The same ids as
    ``bucket_ids`` of the gathered keys, without the gather's copy and the ids' scatter."""
    if keys.stride(-1) != 1 or ids.stride(-1) != 1:
        raise ValueError("keys and ids need a contiguous last dimension")
    if (ids.shape[0], ids.shape[1], ids.shape[3]) != (keys.shape[0], keys.shape[1], keys.shape[2]) \
            or ids.shape[2] != w.shape[1] or pages.shape != offsets.shape or pages.dim() != 1:
        raise ValueError(f"shapes do not fit: keys {tuple(keys.shape)}, ids {tuple(ids.shape)}, w {tuple(w.shape)}, "
                         f"pages {tuple(pages.shape)}, offsets {tuple(offsets.shape)}")
    _launch_buckets(w, keys, ids, pages, offsets, pages.shape[0], precision)


def _launch_buckets(w: torch.Tensor, x: torch.Tensor, out: torch.Tensor, pg: torch.Tensor | None,
                    off: torch.Tensor | None, m: int, precision: str | None, block_m: int | None = None) -> None:
    """x ``[X, h, rows, d]`` / out ``[X, h, L, rows]``: m rows addressed (pg[i], off[i]) when given, else
    rows 0..m-1 of x[0] / out[0]. ``block_m`` (keys per program, a power of two >= 16) overrides the
    default, for benchmarks."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    h, tables, planes, d = w.shape
    if x.shape[1] != h or x.shape[3] != d or d < 16 or d & (d - 1) or not 1 <= planes <= 16:
        raise ValueError(f"shapes do not fit: w {tuple(w.shape)}, x {tuple(x.shape)} (d a power of two >= 16)")
    w = w if w.dtype == torch.float32 and w.stride(-1) == 1 else w.float().contiguous()
    if m and h:
        # One program per (BLOCK_M keys, head, group of tables): the group's planes side by side make one
        # [BLOCK_M, d] x [d, 64] product (a loop over the tables, one [d, 16]-padded product each, hashed a
        # 32K-token prompt at 1.7 ms a layer on an H200; one program looping over every group with its keys
        # loaded once, 0.51 ms against 0.33), and a decode step's few keys still spread over h x L / GROUP
        # programs.
        if precision is None:
            precision = "ieee" if interpreting() else ("bf16x3" if x.dtype == torch.bfloat16 else "tf32x3")
        if precision == "bf16x3" and x.dtype != torch.bfloat16:
            raise ValueError(f"precision bf16x3 needs bf16 keys, got {x.dtype}")
        block = block_m or min(_HASH_ROWS, max(16, next_pow2(m)))
        p_pad = next_pow2(planes)
        group = max(1, _HASH_COLS // p_pad)
        slots = pg is not None
        _bucket_kernel[(-(-m // block), h, -(-tables // group))](
            x, w, out, pg if slots else x, off if slots else x, m, planes, tables, x.stride(0), x.stride(1),
            x.stride(2), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1), out.stride(2),
            BLOCK_M=block, HEAD_DIM=d, P_PAD=p_pad, GROUP=group,
            PRECISION="ieee" if precision == "bf16x3" else precision, SPLIT=precision == "bf16x3", SLOTS=slots,
            num_warps=4)


def collision_scores_varlen(probs: torch.Tensor, buckets: torch.Tensor, cu_seqlens: torch.Tensor,
                            norms: torch.Tensor | None = None, max_len: int | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """probs [batch, h, L, R] fp32, buckets [h, L, total] (any integer dtype), norms [h, total] or None ->
    fp32 scores [h, total]. ``max_len`` (host int, the longest sequence) sizes the grid; by default the
    packed total, so no host read is needed."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    batch, h, tables, _ = probs.shape
    total = buckets.shape[-1]
    probs = probs if probs.dtype == torch.float32 and probs.stride(-1) == 1 else probs.float().contiguous()
    if buckets.stride(-1) != 1:
        buckets = buckets.contiguous()
    out = torch.empty(h, total, dtype=torch.float32, device=buckets.device) if out is None else out
    longest = total if max_len is None else max_len
    if total and h and batch:
        nrm = norms if norms is not None else out
        if nrm.stride(-1) != 1:
            nrm = nrm.contiguous()
        _collision_kernel[(-(-longest // _SCORE_KEYS), h, batch)](
            probs, buckets, nrm, out, cu_seqlens.to(torch.int32), tables, probs.stride(0), probs.stride(1),
            probs.stride(2), buckets.stride(0), buckets.stride(1), nrm.stride(0), out.stride(0),
            BLOCK_N=_SCORE_KEYS, HAS_NORM=norms is not None, num_warps=4)
    return out


def collision_scores(probs: torch.Tensor, buckets: torch.Tensor, norms: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence: probs [h, L, R], buckets [h, L, n], norms [h, n] or None -> fp32 [h, n]."""
    n = buckets.shape[-1]
    cu = torch.arange(2, dtype=torch.int32, device=buckets.device) * n
    return collision_scores_varlen(probs[None], buckets, cu, norms, max_len=n)
