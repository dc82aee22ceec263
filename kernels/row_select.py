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

- ``N <= single_max`` (8192): one program per row holds the row in registers and finds the kk-th largest
  key by bisection. 1 launch. (Four 8-bit radix levels by ``tl.histogram`` instead took 3x as long on an H200:
  the histogram of a row held in registers costs more than the bisection's passes.)
- larger rows: each row is cut into C chunks, one program per (row, chunk), R * C programs per launch
  (C from a ~1024-program target), over one zeroed scratch buffer (1 memset): three radix levels over 8,
  12 and 12 bits of the keys find the threshold key T and how many of its ties are taken, then a write
  launch puts each chunk's entries at their ascending output positions (a decoupled look-back over the
  row's earlier chunks) and the -1 padding. 4 launches plus the memset; the scores are read once per
  launch (from L2 after the first).

The kernels, and how each step works, are ``row_select_kernels.py``'s; this module picks the path and lays
out the buffers (``select_list_triton``).

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

from . import row_select_kernels as kern
from .common import next_pow2
from .kernel_path import triton_wanted
from .row_select_kernels import CNT_W, STATE_W

SINGLE_MAX = 8192  # largest row the one-program path holds in registers
BITS = (8, 12, 12)  # the key's bits per radix level (level 1 by tl.histogram: its cost grows with the bins)
MANY_ROWS = 128  # rows from which the one-program path runs 4 warps a row at any length
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


def select_list_host(score: torch.Tensor, kk: torch.Tensor, k_max: int, out_width: int) -> torch.Tensor:
    """``select_list`` for tensors that live on the host (the CPU path): the same int64 keys, but one ``topk``
    of just the entries taken (forced ones rank first), sorted into place, instead of a row-wide scatter and
    cumulative sum. It reads the batch's largest count back, which is free on a CPU and impossible inside a
    capture, so it never runs on a GPU. Same contract and output as ``select_list_torch``, its oracle."""
    _check(score, kk, k_max, out_width)
    rows, n = score.shape
    out = torch.full((rows, out_width), -1, dtype=torch.int32)
    if rows == 0 or n == 0 or out_width == 0:
        return out
    forced = score == float("inf")
    cand = torch.isfinite(score)
    key = (order_keys(score).long() << 32) + (0xFFFFFFFF - torch.arange(n))
    key.masked_fill_(~(cand | forced), torch.iinfo(torch.int64).min)
    need = forced.sum(1) + torch.minimum(kk.long().clamp(0, k_max), cand.sum(1))
    m = int(need.max())
    if m == 0:
        return out
    idx = torch.topk(key, m, dim=1, sorted=True).indices  # forced first, then the candidates best first
    idx = torch.where(torch.arange(m)[None, :] < need[:, None], idx, n).sort(dim=1).values[:, :out_width]
    out[:, : idx.shape[1]] = torch.where(idx == n, -1, idx)
    return out


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
        # 8 warps beat 16 at 8192 columns on the H100; with a program or more per SM (192 rows of 7168, an
        # H200) 4 beat 8 (27 against 31 us, record socket_kernels_gpu_h200_2026-12-04).
        warps = num_warps or (4 if np_ <= 1024 or rows >= MANY_ROWS else 8)
        kern.single_kernel[(rows,)](score, kk, out, n, k_max, out_width, NP=np_, PB=pb, num_warps=warps)
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
        kern.hist_kernel[grid](score, kk, hist, cnt, state, n, c, k_max, hrow, LEVEL=level, CHUNK=chunk,
                               B1=bits[0], B2=bits[1], B3=bits[2], LOCAL=local_hist, num_warps=warps)
    padw = -(-out_width // c)
    kern.write_kernel[grid](score, state, look, ticket, out, n, c, out_width, padw, CHUNK=chunk,
                            CP=next_pow2(c), PB=min(pb, next_pow2(padw)), num_warps=warps)
    return out


def select_list(score: torch.Tensor, kk: torch.Tensor, k_max: int, out_width: int) -> torch.Tensor:
    """Ascending forced + top-kk column lists [R, out_width] int32, -1 padded (see the module docstring):
    Triton on CUDA tensors (or when ``RAYSPARSE_KERNELS=triton``), the host form on CPU tensors, else the
    capturable PyTorch form."""
    if triton_wanted(score, kk):
        return select_list_triton(score, kk, k_max, out_width)
    if score.device.type == "cpu":
        return select_list_host(score, kk, k_max, out_width)
    return select_list_torch(score, kk, k_max, out_width)
