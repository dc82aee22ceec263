"""The tensor-parallel all-reduce fused with the residual add and the RMSNorm that follow it, in one launch
over symmetric memory (peers' buffers mapped into every rank's address space).

A TP decode step ends each attention block and each MLP with all-reduce -> residual add -> RMSNorm. At
batch 1 each is a few microseconds of work behind a graph node's fixed cost, so the three as one kernel
save a node per reduce (64 per step for 32 layers). One program per row: it copies its row of the local
partial sum into this rank's buffer, meets the same program on every peer at a barrier (a flag in each
peer's signal pad, set with release and cleared by the waiter with acquire, both at system scope), sums
the peers' rows in rank order (every rank the same order, so every rank gets the same bits), rounds to the
model dtype (what an NCCL sum of the dtype gives), adds the residual, normalises, and meets the peers
again so no peer overwrites a buffer still being read. Rows beyond the signal pad's slots, other dtypes or
sizes take the unfused path (``raysparse.all_reduce``).

Reference: ``add_rms_norm(all_reduce(x), residual, w, eps)`` (``kernels/fused_ops.py``), what the model
runs without it; the GPU test compares the two on fresh random inputs.
"""

from __future__ import annotations

import torch

from .common import next_pow2, tl, triton
from .fused_ops import norm_row_store


@triton.jit
def _barrier(SIG, slot, rank, WORLD: tl.constexpr):
    """Every rank's program ``slot`` waits for the same program of every peer. Must follow a CTA barrier
    (``tl.debug_barrier``) so the release publishes the whole program's writes."""
    for p in tl.static_range(WORLD):
        if p != rank:
            peer = tl.load(SIG + p).to(tl.pointer_type(tl.int32))
            while tl.atomic_cas(peer + slot * WORLD + rank, 0, 1, sem="release", scope="sys") != 0:
                pass
    own = tl.load(SIG + rank).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(WORLD):
        if p != rank:
            while tl.atomic_cas(own + slot * WORLD + p, 1, 0, sem="acquire", scope="sys") != 1:
                pass


@triton.jit
def _allreduce_add_norm_kernel(X, R, W, OUT, H, BUF, SIG, n, eps, rank, stride_x, stride_r, stride_o, stride_h,
                               WORLD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=ok, other=0.0)
    mine = tl.load(BUF + rank).to(tl.pointer_type(x.dtype))
    tl.store(mine + row.to(tl.int64) * n + cols, x, mask=ok)
    tl.debug_barrier()
    _barrier(SIG, row, rank, WORLD)
    tl.debug_barrier()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in tl.static_range(WORLD):
        src = tl.load(BUF + p).to(tl.pointer_type(x.dtype))
        acc += tl.load(src + row.to(tl.int64) * n + cols, mask=ok, other=0.0, volatile=True).to(tl.float32)
    tl.debug_barrier()
    _barrier(SIG, row, rank, WORLD)  # every peer has read this rank's row: the buffer may be reused
    s = acc.to(x.dtype).to(tl.float32)
    r = tl.load(R + row.to(tl.int64) * stride_r + cols, mask=ok, other=0.0)
    h = (s + r.to(tl.float32)).to(x.dtype)
    tl.store(H + row.to(tl.int64) * stride_h + cols, h, mask=ok)
    norm_row_store(h, W, OUT + row.to(tl.int64) * stride_o, cols, ok, n, eps)


class AllReduceAddNorm:
    """``(rms_norm(h), h)`` for ``h = residual + all_reduce(x)`` in one launch, for rows up to ``max_rows``
    of width ``hidden`` in ``dtype``; ``eligible`` says when a call can take it."""

    def __init__(self, group_name: str, device: torch.device, dtype: torch.dtype, hidden: int,
                 max_rows: int = 64) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.buf = symm_mem.empty(max_rows * hidden, dtype=dtype, device=device)
        self.buf.zero_()
        handle = symm_mem.rendezvous(self.buf, group_name)
        self.world, self.rank = handle.world_size, handle.rank
        pad_slots = handle.signal_pad_size // 4
        self.max_rows = min(max_rows, pad_slots // self.world)
        self.dtype, self.hidden = dtype, hidden
        self.buf_ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        self.sig_ptrs = torch.tensor(list(handle.signal_pad_ptrs), dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)
        handle.barrier()

    def eligible(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> bool:
        rows = x.numel() // max(x.shape[-1], 1)
        return (x.dtype == residual.dtype == self.dtype and x.shape == residual.shape
                and x.shape[-1] == self.hidden and 0 < rows <= self.max_rows and weight.dtype == self.dtype)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.shape[-1]
        x2 = x.reshape(-1, n)
        r2 = residual.reshape(-1, n)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        out = torch.empty_like(x2)
        h = torch.empty_like(x2)
        block = next_pow2(n)
        _allreduce_add_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, h, self.buf_ptrs, self.sig_ptrs, n, eps, self.rank, x2.stride(0), r2.stride(0),
            out.stride(0), h.stride(0), WORLD=self.world, BLOCK=block, num_warps=min(16, max(1, block // 256)))
        return out.view(x.shape), h.view(x.shape)
