"""Row copies by index on the GPU, reading pinned host memory in place: ``dst[dst_rows[i]] = src[src_rows[i]]``.

``src`` and ``dst`` are viewed as rows ``[N, D]``; ``src_rows`` / ``dst_rows`` [n] int64 (on the GPU) name each
copy's rows, and a negative index on either side skips that copy, so a caller masks copies without a boolean
index (which would read a count back to the host). Two (src, dst) pairs share one index list and one launch (a
K/V tier moves K and V rows together).

Why a kernel: the K/V tiers keep every page in page-locked host memory, which a GPU addresses directly through
unified virtual addressing. A decode step that stages a token-level selection moves hundreds of thousands of
scattered 256-byte rows per layer; gathered by the host (``index_select`` into a pinned buffer, then one DMA) that
is host memory traffic at one core's speed, plus a host read of the indices. Here the GPU's own loads cross the
bus, many rows in flight per program, with the indices never leaving the device. The same kernel serves
device-to-device copies (the tier's slots and row cache), so a step's staging needs no host work at all.

``copy_rows_torch`` is the reference and the CPU path.
"""

from __future__ import annotations

import torch

from .common import next_pow2, tl, triton


def copy_rows_torch(pairs: list[tuple[torch.Tensor, torch.Tensor]], src_rows: torch.Tensor,
                    dst_rows: torch.Tensor) -> None:
    """The reference: for each (src, dst) in ``pairs``, ``dst[dst_rows] = src[src_rows]`` over the copies whose
    indices are both non-negative (rows of ``D`` = the last dimension)."""
    keep = (src_rows >= 0) & (dst_rows >= 0)
    s, d = src_rows[keep], dst_rows[keep]
    for src, dst in pairs:
        flat_dst = dst.view(-1, dst.shape[-1])
        flat_dst.index_copy_(0, d.to(flat_dst.device),
                             src.reshape(-1, src.shape[-1]).index_select(0, s.to(src.device)).to(flat_dst.device))


class _HostRows:
    """A pinned host tensor as the pointer a GPU kernel loads through: with unified addressing a page-locked host
    address is valid on the device as it is. Triton takes any object with ``data_ptr`` and ``dtype``."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.t.data_ptr()


if triton is not None:

    @triton.jit
    def _copy_rows_kernel(src0, dst0, src1, dst1, src_rows, dst_rows, n, D: tl.constexpr, BLOCK_D: tl.constexpr,
                          ROWS: tl.constexpr, PAIRS: tl.constexpr):
        pid = tl.program_id(0)
        r = pid * ROWS + tl.arange(0, ROWS)
        live = r < n
        s = tl.load(src_rows + r, mask=live, other=-1)[:, None]
        d = tl.load(dst_rows + r, mask=live, other=-1)[:, None]
        go = (s >= 0) & (d >= 0)  # masked lanes load nothing: a skipped copy may hold any index
        for c in tl.static_range(0, D, BLOCK_D):
            col = (c + tl.arange(0, BLOCK_D))[None, :]
            m = go & (col < D)
            tl.store(dst0 + d * D + col, tl.load(src0 + s * D + col, mask=m), mask=m)
            if PAIRS == 2:
                tl.store(dst1 + d * D + col, tl.load(src1 + s * D + col, mask=m), mask=m)


def copy_rows(pairs: list[tuple[torch.Tensor, torch.Tensor]], src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """``copy_rows_torch`` as one Triton launch: ``dst`` on the GPU (or the CPU under the interpreter), each ``src``
    on the same device or in pinned host memory (read in place). One or two pairs, each pair's rows of one width
    and dtype; ``src_rows`` and ``dst_rows`` contiguous int64 of one length on ``dst``'s device."""
    if not 1 <= len(pairs) <= 2:
        raise ValueError(f"copy_rows takes one or two (src, dst) pairs, got {len(pairs)}")
    width = pairs[0][1].shape[-1]
    for src, dst in pairs:
        if src.shape[-1] != width or dst.shape[-1] != width or src.dtype != dst.dtype:
            raise ValueError("copy_rows: every pair's rows must share one width and dtype")
        if not (src.is_contiguous() and dst.is_contiguous()):
            raise ValueError("copy_rows: src and dst must be contiguous")
    if src_rows.shape != dst_rows.shape or src_rows.dim() != 1:
        raise ValueError(f"copy_rows: index lists of one length, got {tuple(src_rows.shape)} "
                         f"and {tuple(dst_rows.shape)}")
    n = src_rows.numel()
    if n == 0:
        return
    src_rows, dst_rows = src_rows.long().contiguous(), dst_rows.long().contiguous()
    on_gpu = pairs[0][1].is_cuda
    args: list[object] = []
    for src, dst in (pairs[0], pairs[-1]):
        if on_gpu and not src.is_cuda:
            # the check asks the driver about the pointer, which a stream capture must not: a captured call's
            # tensors are its eager warm-up's, checked there
            if not torch.cuda.is_current_stream_capturing() and not src.is_pinned():
                raise ValueError("copy_rows: a host source of a GPU copy must be pinned (page-locked) memory")
            args += [_HostRows(src), dst]
        else:
            args += [src, dst]
    block_d = min(next_pow2(width), 256)
    rows = max(1, 4096 // block_d)  # 4096 elements a program (32 rows at d = 128): loads in flight
    _copy_rows_kernel[(triton.cdiv(n, rows),)](*args, src_rows, dst_rows, n, D=width, BLOCK_D=block_d, ROWS=rows,
                                                PAIRS=len(pairs), num_warps=4)
