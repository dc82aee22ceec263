"""The K/V tiers' row copies (``kernels/row_copy``): the Triton kernel against the PyTorch reference, and the
reference against a plain loop, on random rows with skipped copies. Without a GPU the kernel runs in Triton's CPU
interpreter (TRITON_INTERPRET=1, set by conftest before Triton is imported)."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV  # before raysparse.kernels: without a GPU it picks the interpreter

from raysparse.kernels import row_copy

BASE = int(torch.randint(0, 2**31 - 1, ()))  # fresh inputs each run; every failure names its seed


def _case(seed: int, width: int, dtype: torch.dtype, n: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    src_n, dst_n = 97, 61
    srcs = [torch.randn(src_n, 2, width, generator=g).to(dtype) for _ in range(2)]  # rows of the last dimension
    dsts = [torch.randn(dst_n, width, generator=g).to(dtype) for _ in range(2)]
    src_rows = torch.randint(-3, 2 * src_n, (n,), generator=g)  # negatives skip
    src_rows = torch.where(src_rows >= 2 * src_n, -1, src_rows)
    dst_rows = torch.randperm(dst_n, generator=g)[:n]  # distinct destinations: the result is defined
    dst_rows[torch.rand(n, generator=g) < 0.2] = -1
    return srcs, dsts, src_rows, dst_rows


@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("width,dtype", [(64, torch.bfloat16), (128, torch.float16), (48, torch.float32),
                                         (512, torch.bfloat16)])
def test_copy_rows_kernel_equals_the_reference(case: int, width: int, dtype: torch.dtype) -> None:
    seed, n = BASE + case, 40 + case
    srcs, dsts, src_rows, dst_rows = _case(seed, width, dtype, n)
    want = [d.clone() for d in dsts]
    for s, d in zip(srcs, want, strict=True):  # the plain loop
        flat = s.reshape(-1, width)
        for i in range(n):
            if src_rows[i] >= 0 and dst_rows[i] >= 0:
                d[dst_rows[i]] = flat[src_rows[i]]
    ref = [d.clone() for d in dsts]
    row_copy.copy_rows_torch(list(zip(srcs, ref, strict=True)), src_rows, dst_rows)
    for a, b in zip(ref, want, strict=True):
        assert torch.equal(a, b), f"seed {seed}: the reference"
    for pairs in (1, 2):
        got = [d.to(DEV) for d in dsts]
        row_copy.copy_rows(list(zip([s.to(DEV) for s in srcs], got, strict=True))[:pairs], src_rows.to(DEV),
                           dst_rows.to(DEV))
        got = [t.cpu() for t in got]
        for i in range(2):
            expect = want[i] if i < pairs else dsts[i]  # an unnamed pair is untouched
            assert torch.equal(got[i], expect), f"seed {seed}, {pairs} pair(s), tensor {i}: " \
                f"{(got[i].float() - expect.float()).abs().max()}"


def test_copy_rows_refuses_mismatched_pairs() -> None:
    a, b = torch.zeros(4, 8), torch.zeros(4, 16)
    rows = torch.arange(2)
    with pytest.raises(ValueError, match="width"):
        row_copy.copy_rows([(a, b)], rows, rows)
    with pytest.raises(ValueError, match="one length"):
        row_copy.copy_rows([(a, a)], rows, torch.arange(3))
    with pytest.raises(ValueError, match="one or two"):
        row_copy.copy_rows([], rows, rows)
