"""The CPU's fast paths of the seam against the gathering references: the fused block-sparse prefill."""

from __future__ import annotations

import pytest
import torch

from raysparse.kernels.paged_torch import block_sparse_prefill_torch
from raysparse.kernels.reference import block_sparse_attention
from raysparse.kernels.selection import BlockSelection, indices_from_mask


@pytest.mark.parametrize("n_q,n", [(700, 1500), (1, 77), (130, 130), (64, 64), (300, 1000)])
def test_cpu_block_sparse_prefill_matches_reference(n_q, n):
    """Every output and lse element, on random selections with the sink and diagonal forced and ragged block
    fills (chunks of different widths)."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    g = torch.Generator().manual_seed(seed)
    h, h_kv, d, b = 6, 2, 16, 32
    q, k, v = (torch.randn(*s, generator=g) for s in ((n_q, h, d), (h_kv, n, d), (h_kv, n, d)))
    qb0 = (n - n_q) // b
    qb = torch.arange(qb0, (n - 1) // b + 1)[:, None]
    kb = torch.arange(-(-n // b))[None]
    mask = ((torch.rand(h_kv, qb.shape[0], kb.shape[1], generator=g) < 0.3) & (kb <= qb)) | (kb == qb) | (kb == 0)
    sel = BlockSelection(indices_from_mask(mask), b)
    want, want_lse = block_sparse_attention(q, k, v, sel)
    got, lse = block_sparse_prefill_torch(q, k, v, sel.indices, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")
