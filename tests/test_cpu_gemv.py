"""The CPU's few-row products (``kernels/cpu_gemv.py``) against an fp64 reference, and the dispatcher's choice."""

from __future__ import annotations

import random

import pytest
import torch

from raysparse.kernels import cpu_gemv, dispatch

pytestmark = pytest.mark.skipif(cpu_gemv._lib() is None, reason="no C compiler here")


@pytest.mark.parametrize("trial", range(6))
def test_rows_match_fp64_reference_on_every_element(trial):
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    rows = trial % cpu_gemv.MAX_ROWS + 1
    n = int(torch.randint(1, 700, (), generator=g))
    k = int(torch.randint(1, 600, (), generator=g))  # tails past the 16-float steps included
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if trial % 2 else None
    assert cpu_gemv.serves(x, w, b)
    out = cpu_gemv.linear(x, w, b)
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    tol = 1e-5 * (x.double().abs() @ w.double().abs().T + 1)  # fp32 rounding of a k-term sum
    assert out.shape == (rows, n) and out.dtype == torch.float32, f"seed {seed}"
    assert ((out.double() - ref).abs() <= tol).all(), f"seed {seed}: max error {(out.double() - ref).abs().max()}"


def test_a_row_does_not_depend_on_the_rows_beside_it():
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(4, 576, generator=g), torch.randn(960, 576, generator=g)
    together = cpu_gemv.linear(x, w)
    for i in range(4):
        assert torch.equal(cpu_gemv.linear(x[i:i + 1].contiguous(), w)[0], together[i]), f"seed {seed}, row {i}"


def test_leading_dims_and_what_it_refuses():
    x, w = torch.randn(1, 2, 64), torch.randn(32, 64)
    assert cpu_gemv.serves(x, w)
    assert torch.allclose(cpu_gemv.linear(x, w), torch.nn.functional.linear(x, w), atol=1e-5)
    assert not cpu_gemv.serves(torch.randn(cpu_gemv.MAX_ROWS + 1, 64), w)  # a GEMM's rows: oneDNN's
    assert not cpu_gemv.serves(torch.randn(2, 64, dtype=torch.float64), w.double())
    assert not cpu_gemv.serves(torch.randn(64, 2).T, w)  # not dense rows
    assert not cpu_gemv.serves(torch.randn(2, 64), torch.randn(64, 32).T)
    assert not cpu_gemv.serves(torch.randn(2, 64), w, torch.randn(31))
    with torch.enable_grad():
        assert not cpu_gemv.serves(torch.randn(2, 64, requires_grad=True), w)


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_dispatch_linear_matches_torch_on_both_sides_of_the_threshold(rows):
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(rows, 200, generator=g), torch.randn(300, 200, generator=g), torch.randn(300, generator=g)
    ref = x.double() @ w.double().T + b.double()
    assert torch.allclose(dispatch.linear(x, w, b).double(), ref, atol=1e-3, rtol=1e-4), f"seed {seed}"
