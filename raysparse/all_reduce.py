"""The tensor-parallel group's SUM all-reduce: NCCL (or gloo on CPU), or a one-shot all-reduce through
PyTorch's symmetric memory for small messages on GPUs.

A decode step of an L-layer model does 2L all-reduces of [batch, hidden]: at batch 1 they are bound by
latency, not bandwidth. Inside a CUDA graph an NCCL all-reduce of 8 KB took 20.7 us on two H200s
(benchmarks/bench_allreduce.py), 64 of them a sixth of a TP=2 step. The one-shot kernel
(``torch.ops.symm_mem.one_shot_all_reduce_copy_out``) copies the local input into a buffer that every
peer maps, meets the peers at a barrier, and each rank sums all peers' buffers itself: one launch, no
NCCL kernel, no proxy thread. Its barriers on entry and exit make back-to-back calls on the one buffer safe.
Messages above ``max_bytes`` (prefill chunks) go through NCCL, where bandwidth matters and its ring wins.

The path is the engine's ``RuntimeConfig.allreduce``: ``auto`` (default: symmetric memory where it is
available and its result is verified against NCCL at start-up on every rank, else NCCL), ``nccl``, or
``symm_mem`` (an error if it cannot be set up or does not verify).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from raysparse.runtime_config import ALLREDUCE as MODES

log = logging.getLogger(__name__)

Reduce = Callable[[torch.Tensor], torch.Tensor]


def collective_all_reduce(group: dist.ProcessGroup | None = None) -> Reduce:
    """In-place SUM all-reduce through the process group's own backend (NCCL or gloo)."""
    def reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    return reduce


class SymmMemAllReduce:
    """One-shot all-reduce of messages up to ``max_bytes`` through symmetric memory; NCCL above that.

    One rendezvoused buffer per dtype (the model's, and fp32 for the walk coordinator's sums), made at
    construction: a rendezvous is collective, so it cannot happen lazily inside a captured graph.
    Returns a new tensor (the graph's pool holds it), leaving the input as it was."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, dtypes: tuple[torch.dtype, ...],
                 max_bytes: int = 1 << 20) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group if group is not None else dist.group.WORLD
        self.name = self.group.group_name
        self.max_bytes = max_bytes
        self.fallback = collective_all_reduce(group)
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # required by older releases, deprecated (and a no-op) in newer ones
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(self.name)
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        for dt in dict.fromkeys(dtypes):
            buf = symm_mem.empty(max_bytes // dt.itemsize, dtype=dt, device=device)
            buf.zero_()
            symm_mem.rendezvous(buf, self.name)
            self.buffers[dt] = buf
        self.op = torch.ops.symm_mem.one_shot_all_reduce_copy_out

    def eligible(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        # the kernel moves 16-byte vectors when both buffers allow it; anything else takes NCCL
        return (x.dtype in self.buffers and x.is_contiguous() and 0 < nbytes <= self.max_bytes
                and nbytes % 16 == 0 and (x.storage_offset() * x.element_size()) % 16 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.eligible(x):
            return self.fallback(x)
        flat = x.view(-1)
        out = torch.empty_like(flat)
        self.op(self.buffers[x.dtype][: flat.numel()], flat, "sum", self.name, out)
        return out.view(x.shape)


def _available() -> bool:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401 - registers torch.ops.symm_mem
    except ImportError:
        return False
    return hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")


def _vote(ok: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """True only if ``ok`` on every rank (one MIN all-reduce through the group's own backend)."""
    flag = torch.tensor([1 if ok else 0], device=device, dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def verify(reduce: Reduce, group: dist.ProcessGroup | None, device: torch.device, dtypes: tuple[torch.dtype, ...],
           hidden: int) -> bool:
    """``reduce`` against the process group's own all-reduce on fresh per-rank random inputs of decode shapes,
    several calls back to back (what a captured step does). True only if it matches on every rank."""
    rank = dist.get_rank(group)
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    ok = True
    for dt in dtypes:
        for rows in (1, 3, 8):
            xs = [torch.randn(rows, hidden, generator=gen, device=device).to(dt) for _ in range(4)]
            got = [reduce(x.clone()) for x in xs]
            for x, y in zip(xs, got, strict=True):
                ref = x.clone()
                dist.all_reduce(ref, group=group)
                tol = 0.0 if dist.get_world_size(group) == 2 else 1e-2  # two operands: one rounding either way
                ok &= bool(torch.isfinite(y).all()) and bool(((y.float() - ref.float()).abs() <= tol).all())
    return _vote(ok, group, device)


def make_all_reduce(device: torch.device | str, dtype: torch.dtype, hidden: int,
                    group: dist.ProcessGroup | None = None, mode: str = "auto") -> tuple[Reduce, str]:
    """The group's SUM all-reduce and the name of the path chosen (``gloo``, ``nccl`` or ``symm_mem``);
    ``mode``: ``RuntimeConfig.allreduce``. Collective: every rank of the group calls it at the same point."""
    if mode not in MODES:
        raise ValueError(f"all-reduce mode must be one of {', '.join(MODES)}, got {mode!r}")
    device = torch.device(device)
    if device.type != "cuda":
        if mode == "symm_mem":
            raise ValueError("the symm_mem all-reduce needs CUDA devices")
        return collective_all_reduce(group), dist.get_backend(group)
    if mode == "nccl":
        return collective_all_reduce(group), "nccl"
    dtypes = (dtype, torch.float32)
    reason = "not available in this PyTorch build"
    # every rank must take the same path, so each stage is voted on before the next collective one
    if _vote(_available(), group, device):
        try:
            reduce: Reduce | None = SymmMemAllReduce(group, device, dtypes)
        except Exception as e:  # noqa: BLE001 - any set-up failure means: not usable here
            reduce, reason = None, f"{type(e).__name__}: {e}"
        if _vote(reduce is not None, group, device):
            assert reduce is not None
            if verify(reduce, group, device, dtypes, hidden):
                return reduce, "symm_mem"
            reason = "its results did not match NCCL's"
        elif reduce is not None:
            reason = "set-up failed on another rank"
    if mode == "symm_mem":
        raise RuntimeError(f"all-reduce symm_mem: symmetric-memory all-reduce unusable ({reason})")
    log.warning("symmetric-memory all-reduce unusable (%s); using NCCL", reason)
    return collective_all_reduce(group), "nccl"


ReduceNorm = Callable[[torch.Tensor, torch.Tensor, Any], tuple[torch.Tensor, torch.Tensor]]


def make_reduce_norm(reduce: Reduce, path: str, device: torch.device | str, dtype: torch.dtype, hidden: int,
                     group: dist.ProcessGroup | None = None, max_rows: int = 64, enabled: bool = True,
                     fused_ops: str = "auto") -> ReduceNorm | None:
    """All-reduce + residual add + RMSNorm as one launch (``kernels/allreduce_norm.py``) where the group
    reduces through symmetric memory; None where it does not, or where the fused kernel's results differ
    from the unfused ones on any rank at start-up (checked here on fresh random rows). Collective.
    ``enabled`` False (``RuntimeConfig.fused_allreduce``) keeps them apart; ``fused_ops``: the model's mode
    (``RuntimeConfig.fused_ops``), which the unfused path the kernel is checked against runs in."""
    if not enabled or path != "symm_mem":
        return None
    device = torch.device(device)
    name = (group if group is not None else dist.group.WORLD).group_name
    try:
        from raysparse.kernels.allreduce_norm import AllReduceAddNorm

        fused: AllReduceAddNorm | None = AllReduceAddNorm(name, device, dtype, hidden, max_rows)
    except Exception as e:  # noqa: BLE001 - any set-up failure: keep the unfused path
        log.warning("fused all-reduce + norm unavailable (%s: %s)", type(e).__name__, e)
        fused = None
    if not _vote(fused is not None, group, device):
        return None
    assert fused is not None

    def reduce_norm(x: torch.Tensor, residual: torch.Tensor, norm: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if fused.eligible(x, residual, norm.weight):
            return fused(x, residual, norm.weight, norm.eps)
        return norm.add_forward(reduce(x), residual)

    from raysparse.layers import RMSNorm

    gen = torch.Generator(device=device).manual_seed(4321 + dist.get_rank(group))
    norm = RMSNorm(hidden, 1e-5).to(device=device, dtype=dtype)
    norm.fused_mode = fused_ops
    norm.weight.data.copy_(1 + 0.1 * torch.randn(hidden, generator=gen, device=device))
    dist.broadcast(norm.weight.data, 0, group=group)  # one norm weight on every rank, as in the model
    ok = True
    for rows in (1, 5, fused.max_rows):
        x = torch.randn(rows, hidden, generator=gen, device=device).to(dtype)
        r = torch.randn(rows, hidden, generator=gen, device=device).to(dtype)
        dist.broadcast(r, 0, group=group)  # the residual stream is the same on every rank
        try:
            got = [reduce_norm(x, r, norm) for _ in range(3)]  # back to back, as in a step
        except Exception as e:  # noqa: BLE001 - e.g. the kernel does not compile here (the same on every rank)
            log.warning("fused all-reduce + norm failed (%s: %s)", type(e).__name__, e)
            ok, got = False, []
        want = norm.add_forward(collective_all_reduce(group)(x.clone()), r)
        for out, h in got:
            ok &= bool(torch.equal(out, want[0]) and torch.equal(h, want[1]))
    if _vote(ok, group, device):
        return reduce_norm
    log.warning("fused all-reduce + norm did not match the unfused path; keeping them apart")
    return None
