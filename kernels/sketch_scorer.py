"""Sketch&Walk's scorer kernels: the subsampled randomized Hadamard sketch (``SRHT.apply``) and, fused with
it, the per-block sums of the head-averaged Q or K (a ragged segment reduction).

SRHT (``scorer_reference.srht_reference``): a row x of ``dim`` values is zero-padded to d' = next_pow2(dim),
multiplied by the random signs, put through the orthonormal fast Walsh-Hadamard transform (log2 d'
butterfly stages on the register tile) and subsampled to the r drawn coordinates, scaled by sqrt(d'/r).
The subsample is a scatter on store: column c of the transform goes to output column ``slots[c]`` (-1:
dropped), so no gather inside the tile is needed.

Block sums: x ``[T, heads, d]`` packs the new tokens of a ragged batch (any strides with a contiguous
last dim, so K's ``[h_kv, n, d]`` slice is passed as a transposed view). Sequence i owns rows
``cu[i]:cu[i+1]`` at absolute positions ``q_start_i + t``; they touch absolute blocks ``q_start_i // B ..
(q_start_i + q_len_i - 1) // B``, packed from ``blk_start[i]`` (a partial first or last block sums only
the new tokens it holds, as the reference's ``index_add``). One program per packed block sums its
(token, head) rows in fp32 tiles, multiplies by ``1 / head_count`` (the model's count under tensor
parallelism), sketches the sum and writes its r floats.

Decode sketches (``decode_sketches``, the paired graph decode's per-layer input): for each row and KV head,
the mean of the head's query group and the new key read from its paged cache slot, both sketched in one
two-row tile: one launch instead of the gather, casts, mean, stack and sketch (six kernels).
"""

from __future__ import annotations

import math

import torch

from .common import interpreting, tl, triton

_SRHT_ROWS = 16  # rows of x per program in the plain sketch
_SUM_ROWS = 64  # (token, head) rows summed per step


if triton is not None:

    @triton.jit
    def fwht_tile(x, BM: tl.constexpr, DP: tl.constexpr, LOG_DP: tl.constexpr):
        """Unnormalised Walsh-Hadamard transform (Sylvester order) of every row of x [BM, DP]: stage s
        turns entries j and j + 2**s of each 2**(s+1)-long segment into (a + b, a - b)."""
        for s in tl.static_range(LOG_DP):  # stage s pairs entries 2**s apart
            y = tl.permute(tl.reshape(x, [BM, DP >> (s + 1), 2, 1 << s]), [0, 1, 3, 2])
            a, b = tl.split(y)
            x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [BM, DP])
        return x

    @triton.jit
    def _srht_kernel(X, Out, SIGNS, SLOTS, m_rows, dim, stride_xm, stride_om, factor,
                     BM: tl.constexpr, DP: tl.constexpr, LOG_DP: tl.constexpr):
        r = tl.program_id(0) * BM + tl.arange(0, BM)
        c = tl.arange(0, DP)
        r_ok = r < m_rows
        x = tl.load(X + r.to(tl.int64)[:, None] * stride_xm + c[None, :], mask=r_ok[:, None] & (c < dim)[None, :],
                    other=0.0).to(tl.float32)
        y = fwht_tile(x * tl.load(SIGNS + c)[None, :], BM, DP, LOG_DP) * factor
        slot = tl.load(SLOTS + c)
        out_off = r.to(tl.int64)[:, None] * stride_om + slot[None, :]
        tl.store(Out + out_off, y, mask=r_ok[:, None] & (slot >= 0)[None, :])

    @triton.jit
    def _block_sketch_kernel(X, Out, SIGNS, SLOTS, CU, QSTART, BLK_SEQ, BLK_START, stride_t, stride_h, stride_ob,
                             heads, dim, inv_heads, factor, BLOCK: tl.constexpr, DP: tl.constexpr,
                             LOG_DP: tl.constexpr, ROWS: tl.constexpr):
        pb = tl.program_id(0)
        seq = tl.load(BLK_SEQ + pb)
        t0 = tl.load(CU + seq)
        q_len = tl.load(CU + seq + 1) - t0
        q_start = tl.load(QSTART + seq)
        blk = q_start // BLOCK + pb - tl.load(BLK_START + seq)
        lo = tl.maximum(blk * BLOCK, q_start) - q_start  # this block's new tokens, local indices
        hi = tl.minimum((blk + 1) * BLOCK, q_start + q_len) - q_start
        n_rows = (hi - lo) * heads
        c = tl.arange(0, DP)
        c_ok = c < dim
        acc = tl.zeros([ROWS, DP], dtype=tl.float32)
        for r0 in range(0, n_rows, ROWS):
            m = r0 + tl.arange(0, ROWS)
            tok = (t0 + lo + m // heads).to(tl.int64)
            off = tok[:, None] * stride_t + (m % heads).to(tl.int64)[:, None] * stride_h + c[None, :]
            acc += tl.load(X + off, mask=(m < n_rows)[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        s = tl.sum(acc, 0) * inv_heads
        y = fwht_tile((s * tl.load(SIGNS + c))[None, :], 1, DP, LOG_DP) * factor
        slot = tl.load(SLOTS + c)
        tl.store(Out + pb.to(tl.int64) * stride_ob + slot[None, :], y, mask=(slot >= 0)[None, :])

    @triton.jit
    def _decode_sketch_kernel(Q, K, PAGES, OFFS, Out, SIGNS, SLOTS, stride_qb, stride_qh, stride_kp, stride_kh,
                              stride_kt, stride_o0, stride_ob, stride_oh, dim, inv_g, factor, G: tl.constexpr,
                              GP: tl.constexpr, DP: tl.constexpr, LOG_DP: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        c = tl.arange(0, DP)
        c_ok = c < dim
        g = tl.arange(0, GP)
        q = tl.load(Q + b.to(tl.int64) * stride_qb + (h * G + g).to(tl.int64)[:, None] * stride_qh + c[None, :],
                    mask=(g < G)[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        q_avg = tl.sum(q, 0) * inv_g  # as torch's fp32 mean: the sum times the fp32 1/G
        page = tl.load(PAGES + b).to(tl.int64)
        off = tl.load(OFFS + b).to(tl.int64)
        k = tl.load(K + page * stride_kp + h.to(tl.int64) * stride_kh + off * stride_kt + c, mask=c_ok,
                    other=0.0).to(tl.float32)
        two = tl.arange(0, 2)
        x = tl.where((two == 0)[:, None], q_avg[None, :], k[None, :])
        y = fwht_tile(x * tl.load(SIGNS + c)[None, :], 2, DP, LOG_DP) * factor
        slot = tl.load(SLOTS + c)
        dst = Out + two.to(tl.int64)[:, None] * stride_o0 + b.to(tl.int64) * stride_ob + h * stride_oh
        tl.store(dst + slot[None, :], y, mask=(slot >= 0)[None, :])


def decode_sketches(q: torch.Tensor, k_pages: torch.Tensor, slot_pages: torch.Tensor, slot_offsets: torch.Tensor,
                    signs: torch.Tensor, slots: torch.Tensor, r: int, scale: float) -> torch.Tensor:
    """q [bsz, h, d] (whole query groups of k's heads), k_pages [pages, h_kv, page, d] (one layer's paged
    keys), each row's new key at (slot_pages, slot_offsets) -> fp32 [2, bsz, h_kv, r]: the SRHT of each KV
    head's query-group mean (row 0) and of its new key (row 1), as ``srht_apply`` of those rows."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    dp, log_dp = _check(signs, slots)
    bsz, h, dim = q.shape
    h_kv = k_pages.shape[1]
    if h % h_kv or k_pages.shape[-1] != dim or dim > dp or slot_pages.shape != (bsz,) or slot_offsets.shape != (bsz,):
        raise ValueError(f"decode_sketches: q {tuple(q.shape)}, keys {tuple(k_pages.shape)}, slots "
                         f"{tuple(slot_pages.shape)} / {tuple(slot_offsets.shape)}, transform {dp} do not fit")
    if q.stride(-1) != 1 or k_pages.stride(-1) != 1:
        raise ValueError("decode_sketches needs q and the keys contiguous in their last dim")
    g = h // h_kv
    out = torch.empty(2, bsz, h_kv, r, dtype=torch.float32, device=q.device)
    if bsz:
        inv_g = float(torch.tensor(1.0, dtype=torch.float32) / g)
        _decode_sketch_kernel[(bsz, h_kv)](
            q, k_pages, slot_pages, slot_offsets, out, signs.float(), slots, q.stride(0), q.stride(1),
            k_pages.stride(0), k_pages.stride(1), k_pages.stride(2), out.stride(0), out.stride(1), out.stride(2), dim,
            inv_g, scale / math.sqrt(dp), G=g, GP=1 << max(g - 1, 0).bit_length(), DP=dp, LOG_DP=log_dp,
            num_warps=1)
    return out


def srht_slots(coords: torch.Tensor, padded: int) -> torch.Tensor:
    """int32 [d']: the output column of each transform column (its rank among ``coords``), -1 if not drawn."""
    slots = torch.full((padded,), -1, dtype=torch.int32, device=coords.device)
    return slots.index_put_((coords.long(),), torch.arange(coords.numel(), dtype=torch.int32, device=coords.device))


def _check(signs: torch.Tensor, slots: torch.Tensor) -> tuple[int, int]:
    dp = signs.numel()
    if dp & (dp - 1) or slots.numel() != dp:
        raise ValueError(f"signs ({dp}) and slots ({slots.numel()}) must have one power-of-two length")
    return dp, dp.bit_length() - 1


def srht_apply(x: torch.Tensor, signs: torch.Tensor, slots: torch.Tensor, r: int, scale: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., dim] -> fp32 [..., r]: ``fwht(pad(x) * signs)[..., coords] * scale`` (``slots`` from
    ``srht_slots``; ``scale`` = sqrt(d'/r), the transform's 1/sqrt(d') is applied here). ``out``: a
    contiguous fp32 [..., r] buffer to write into."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    dp, log_dp = _check(signs, slots)
    lead, dim = x.shape[:-1], x.shape[-1]
    if dim > dp:
        raise ValueError(f"rows of {dim} values do not fit a transform of {dp}")
    x2 = x.reshape(-1, dim)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, r, dtype=torch.float32, device=x.device) if out is None else out.view(m, r)
    if m:
        _srht_kernel[(-(-m // _SRHT_ROWS),)](x2, out, signs.float(), slots, m, dim, x2.stride(0), out.stride(0),
                                             scale / math.sqrt(dp), BM=_SRHT_ROWS, DP=dp, LOG_DP=log_dp,
                                             num_warps=4)
    return out.view(*lead, r)


def block_plan(q_starts: list[int], q_lens: list[int], block: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """(q_starts, blk_seq, blk_start) as int32 device tensors and the blocks per sequence, from host-side
    lengths. One sequence (a decode step) is built with device fills only: no host-to-device copy, so the
    step stays CUDA-graph capturable."""
    nblk = [(s + n - 1) // block - s // block + 1 if n else 0 for s, n in zip(q_starts, q_lens, strict=True)]
    i32 = dict(dtype=torch.int32, device=device)
    if len(nblk) == 1:
        return (torch.full((1,), q_starts[0], **i32), torch.zeros(nblk[0], **i32), torch.arange(2, **i32) * nblk[0],
                nblk)
    seq = torch.repeat_interleave(torch.arange(len(nblk), dtype=torch.int32), torch.tensor(nblk, dtype=torch.long))
    start = torch.tensor([0, *nblk], dtype=torch.int64).cumsum(0).to(torch.int32)
    return torch.tensor(q_starts, dtype=torch.int32).to(device), seq.to(device), start.to(device), nblk


def block_sketch(x: torch.Tensor, cu_seqlens: torch.Tensor, q_starts: list[int], q_lens: list[int], block: int,
                 signs: torch.Tensor, slots: torch.Tensor, r: int, scale: float, head_count: int | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Sketched per-block sums of the head mean of packed x [T, heads, d] -> fp32 [total_blocks, r],
    sequence i's blocks from ``sum(blocks[:i])`` on (``block_plan``). ``head_count`` divides the head sum
    (default: x's head count). The lengths are host ints, as in ``BatchMeta``."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    dp, log_dp = _check(signs, slots)
    _, heads, dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    qs, blk_seq, blk_start, nblk = block_plan(q_starts, q_lens, block, x.device)
    total = sum(nblk)
    out = torch.empty(total, r, dtype=torch.float32, device=x.device) if out is None else out
    if total:
        _block_sketch_kernel[(total,)](
            x, out, signs.float(), slots, cu_seqlens.to(torch.int32), qs, blk_seq, blk_start, x.stride(0),
            x.stride(1), out.stride(0), heads, dim, 1.0 / (head_count or heads), scale / math.sqrt(dp), BLOCK=block,
            DP=dp, LOG_DP=log_dp, ROWS=_SUM_ROWS if not interpreting() else 256, num_warps=4)
    return out
