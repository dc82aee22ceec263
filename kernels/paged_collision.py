"""SOCKET's soft-collision scores of a decode batch, read from per-page bucket ids through the page table.

``probs [B, h, L, R]`` fp32 or fp16 (the batch's group-reduced bucket distributions), ``ids [pages + 1, h,
L, page]`` (a cache page's bucket ids per KV head and table, any integer dtype), ``norms [pages + 1, h, page]``
fp32 or None, ``page_table [B, W]`` int32 and ``seqlens [B]`` -> fp32 ``[B, h, W * page]``: ``sum_l probs[l,
id_l(j)]`` (summed in fp32, times ``||v_j||``) for every token j of each row, -inf past the row's length.
``forced = (sink, local)`` (int ``[B]`` each), if given, sets a row's first ``sink`` and last ``local``
tokens to +inf, the encoding the list selection takes as forced. Fixed shapes, no host read: it runs inside
a captured decode step. The PyTorch form is the reference and the CPU path.
"""

from __future__ import annotations

import torch

from .common import tl, triton

# Table entries gathered at once by the PyTorch form: bounds its int64 index (32 MiB). Larger chunks are
# faster on a CPU (one gather of a 4096-token row, 3 KV heads, 60 tables: 0.39 ms, against 0.52 ms in chunks
# of 2**18 entries and 0.73 ms in chunks of 2**16, 2-core CPU).
_GATHER_ELEMS = 1 << 22


def paged_collision_torch(probs: torch.Tensor, ids: torch.Tensor, norms: torch.Tensor | None,
                          page_table: torch.Tensor, seqlens: torch.Tensor,
                          forced: tuple[torch.Tensor, torch.Tensor] | None = None,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """The PyTorch form. ``bias``, if given, is the rows' ``forced_bias`` (``forced`` is then not read): it
    depends on the step alone, so a caller scoring many layers of one step builds it once."""
    # Pages are read with one index_select per chunk of pages and scored in their pool layout [B, pages, h, L,
    # page] against the probabilities broadcast over the pages, every table at once: no permuted copy of the
    # ids (1.6x faster on a CPU than table chunks over a permuted copy, measured at 4K tokens, 3 KV heads, 60
    # tables).
    b, h, tables, r = probs.shape
    probs = probs.float()
    page = ids.shape[-1]
    width = page_table.shape[1]
    table = page_table.long()
    score = torch.empty(b, width, h, page, dtype=torch.float32, device=probs.device)
    step = max(1, _GATHER_ELEMS // max(1, b * h * tables * page))
    for c0 in range(0, width, step):
        c1 = min(width, c0 + step)
        rows = ids.index_select(0, table[:, c0:c1].reshape(-1)).view(b, c1 - c0, h, tables, page)
        pe = probs[:, None].expand(b, c1 - c0, h, tables, r)
        torch.sum(pe.gather(-1, rows.long()), 3, out=score[:, c0:c1])
    if norms is not None:
        score *= norms.index_select(0, table.reshape(-1)).view(b, width, h, page)
    score = score.transpose(1, 2).reshape(b, h, width * page)
    # The scores are finite and >= 0, so adding the bias sets the forced tokens (+inf) and those past the
    # length (-inf) and leaves the others' bits: one pass instead of two masks.
    return score.add_(bias if bias is not None else forced_bias(forced, seqlens, width * page))


def forced_bias(forced: tuple[torch.Tensor, torch.Tensor] | None, seqlens: torch.Tensor, width: int) -> torch.Tensor:
    """fp32 ``[B, 1, width]``: +inf at each row's ``forced = (sink, local)`` tokens (``forced_tokens``; none
    when None), -inf from its length on, 0 elsewhere."""
    j = torch.arange(width, device=seqlens.device)
    past = j >= seqlens.long()[:, None]
    bias = torch.zeros(past.shape, dtype=torch.float32, device=seqlens.device)
    if forced is not None:
        bias.masked_fill_(forced_tokens(*forced, seqlens, width), float("inf"))
    return bias.masked_fill_(past, float("-inf"))[:, None]  # past the length wins over a sink count above it


def forced_tokens(sink: torch.Tensor, local: torch.Tensor, seqlens: torch.Tensor, width: int) -> torch.Tensor:
    """bool ``[B, width]``: each row's first ``sink`` and last ``local`` of its ``seqlens`` tokens."""
    j = torch.arange(width, device=seqlens.device)
    n = seqlens.long()[:, None]
    return (j < sink.long()[:, None]) | ((j >= n - local.long()[:, None]) & (j < n))


if triton is not None:

    @triton.jit
    def _paged_collision_kernel(P, IDS, NORM, PT, SEQ, SINK, LOCAL, Out, tables, width,
                                stride_pb, stride_ph, stride_pl, stride_ip, stride_ih, stride_il,
                                stride_np, stride_nh, stride_tb, stride_ob, stride_oh,
                                PAGE: tl.constexpr, PAGES: tl.constexpr, TABLES: tl.constexpr,
                                HAS_NORM: tl.constexpr, FORCED: tl.constexpr):
        j = tl.program_id(0) * PAGES + tl.arange(0, PAGES)  # this program's pages of the row
        h = tl.program_id(1).to(tl.int64)
        b = tl.program_id(2).to(tl.int64)
        n = tl.load(SEQ + b)
        off = tl.arange(0, PAGE)
        tok = j[:, None] * PAGE + off[None, :]  # [PAGES, PAGE]
        ok = tok < n
        in_row = j < width
        out_row = Out + b * stride_ob + h * stride_oh + tok
        if tl.program_id(0) * PAGES * PAGE < n:
            live = in_row & (j * PAGE < n)  # a page's ids past the length are read (one mask a page keeps the
            live_t = live[:, None]  # loads vectorised) and dropped at the store
            pg = tl.load(PT + b * stride_tb + j, mask=live, other=0).to(tl.int64)
            id_row = IDS + pg[:, None] * stride_ip + h * stride_ih + off[None, :]
            prob_row = P + b * stride_pb + h * stride_ph
            acc = tl.zeros([PAGES, PAGE], dtype=tl.float32)
            if TABLES > 0:  # unrolled: every table's ids load at once instead of one load, then its gather, a turn
                for t in tl.static_range(TABLES):
                    ids = tl.load(id_row + t * stride_il, mask=live_t, other=0).to(tl.int32)
                    acc += tl.load(prob_row + t * stride_pl + ids).to(tl.float32)
            else:
                for t in range(tables):
                    ids = tl.load(id_row + t * stride_il, mask=live_t, other=0).to(tl.int32)
                    acc += tl.load(prob_row + t * stride_pl + ids).to(tl.float32)
            if HAS_NORM:
                acc *= tl.load(NORM + pg[:, None] * stride_np + h * stride_nh + off[None, :], mask=live_t, other=0.0)
            if FORCED:
                sink = tl.load(SINK + b)
                local = tl.load(LOCAL + b)
                acc = tl.where((tok < sink) | (tok >= n - local), float("inf"), acc)
            tl.store(out_row, tl.where(ok, acc, float("-inf")), mask=in_row[:, None])
        else:
            tl.store(out_row, tl.full([PAGES, PAGE], float("-inf"), tl.float32), mask=in_row[:, None])


UNROLL_MAX = 64  # tables unrolled in the kernel; more take its runtime loop


def paged_collision(probs: torch.Tensor, ids: torch.Tensor, norms: torch.Tensor | None, page_table: torch.Tensor,
                    seqlens: torch.Tensor, forced: tuple[torch.Tensor, torch.Tensor] | None = None,
                    num_warps: int = 1, pages_per_program: int = 1, unroll: bool = True) -> torch.Tensor:
    """The Triton form: one program per ``pages_per_program`` pages of the row, KV head and row, one table's ids
    of its pages per load, the tables unrolled (``unroll``, up to ``UNROLL_MAX``) so their loads overlap.
    ``num_warps``, ``pages_per_program`` and ``unroll`` are knobs for ``benchmarks/bench_decode_scorers.py``; the
    defaults (one page, unrolled, one warp) were fastest at both of its decode shapes on an H200 (record
    ``socket_kernels_gpu_h200_2026-12-04``), where the probabilities' gathers bound the kernel (a row's table
    gathered by ``tl.gather`` instead took 8-12x as long)."""
    b, h, tables, _ = probs.shape
    page, width = ids.shape[-1], page_table.shape[1]
    if pages_per_program < 1 or pages_per_program & (pages_per_program - 1):
        raise ValueError(f"pages_per_program must be a power of two, got {pages_per_program}")
    if probs.dtype not in (torch.float32, torch.float16):
        probs = probs.float()
    probs = probs.contiguous()
    out = torch.empty(b, h, width * page, dtype=torch.float32, device=probs.device)
    nrm = norms if norms is not None else out
    sink, local = forced if forced is not None else (seqlens, seqlens)
    grid = (triton.cdiv(width, pages_per_program), h, b)
    _paged_collision_kernel[grid](
        probs, ids, nrm, page_table, seqlens, sink, local, out, tables, width,
        probs.stride(0), probs.stride(1), probs.stride(2), ids.stride(0), ids.stride(1), ids.stride(2),
        nrm.stride(0), nrm.stride(1), page_table.stride(0), out.stride(0), out.stride(1),
        PAGE=page, PAGES=pages_per_program, TABLES=tables if unroll and tables <= UNROLL_MAX else 0,
        HAS_NORM=norms is not None, FORCED=forced is not None, num_warps=num_warps)
    return out
