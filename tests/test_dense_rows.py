"""Delta's dense rows on the paged cache (``kernels/dense_rows.py``) against the PyTorch reference.

Ragged batches, paged and packed K/V, fp32 and fp16, rows at random positions (not only every gamma-th), and
random "near" block masks (the base's selection per row and KV head) with rows whose every causal block is
near (no far keys: out 0, lse -inf, kbar 0). Every output element is compared.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels import _kv, _seqs, _tol
from triton_env import DEV

from raysparse.kernels import dispatch
from raysparse.kernels.dense_rows import dense_rows
from raysparse.kernels.reference import dense_rows_attention

B = 64
CASES = [  # (g, d, layout, dtype, far)
    (4, 64, "paged", torch.float32, True),
    (3, 64, "packed", torch.float16, True),
    (2, 128, "paged", torch.float16, False),
]


def _rows(lens: list[tuple[int, int]], gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Local query rows of each sequence (sorted, distinct) and their absolute positions."""
    locs, poss = [], []
    for n, nq in lens:
        m = int(torch.randint(1, min(nq, 9) + 1, (1,), generator=gen))
        loc = torch.randperm(nq, generator=gen)[:m].sort().values
        locs.append(loc)
        poss.append(n - nq + loc)
    return locs, poss


@pytest.mark.parametrize("g,d,layout,dtype,far", CASES)
def test_dense_rows_match_the_reference(g: int, d: int, layout: str, dtype: torch.dtype, far: bool) -> None:
    seed = int(torch.randint(0, 2**31 - 1, (1,)))
    gen = torch.Generator().manual_seed(seed)
    lens = [(300, 300), (500, 77), (130, 1), (70, 5)]
    seqs = _seqs(lens, g, d, dtype, gen)
    q = torch.cat([s[0] for s in seqs])
    kv = _kv([s[1] for s in seqs], [s[2] for s in seqs], layout, gen)
    locs, poss = _rows(lens, gen)
    cu_q = torch.tensor([0] + [nq for _, nq in lens]).cumsum(0)
    row_tok = torch.cat([cu_q[i] + loc for i, loc in enumerate(locs)]).to(DEV, torch.int32)
    row_pos = torch.cat(poss).to(DEV, torch.int32)
    rows = [len(loc) for loc in locs]
    nb = max(-(-n // B) for n, _ in lens)
    near = None
    if far:
        near = torch.rand(2, sum(rows), nb, generator=gen) < 0.4
        near[:, 0, :] = True  # the first row: every block near, so no far keys
        near = near.to(DEV)
    got = dense_rows(q, kv, row_tok, row_pos, rows, near)
    via_dispatch = dispatch.dense_rows_attention_varlen(q, kv, row_tok, row_pos, rows, near)
    lo = 0
    for (qi, ki, vi), pos, loc, (n, _) in zip(seqs, poss, locs, lens, strict=True):
        m = len(loc)
        blocks = None if near is None else near[:, lo:lo + m, : -(-n // B)]
        want = dense_rows_attention(qi[loc].float(), pos.to(DEV), ki.float(), vi.float(), blocks, B)
        for j, (a, b, c) in enumerate(zip(got, via_dispatch, want, strict=True)):
            msg = f"seed {seed}, output {j}, rows {lo}:{lo + m}"
            torch.testing.assert_close(a[lo:lo + m], c, **_tol(dtype), msg=msg)
            torch.testing.assert_close(b[lo:lo + m].float(), c, **_tol(dtype), msg=msg)
        lo += m
    if far:
        assert torch.isneginf(got[3][0]).all() and (got[2][0] == 0).all() and (got[4][0] == 0).all()


def test_dense_rows_refuse_a_near_mask_of_other_blocks() -> None:
    gen = torch.Generator().manual_seed(0)
    (q, k, v), = _seqs([(128, 8)], 2, 64, torch.float32, gen)
    kv = _kv([k], [v], "paged", gen)
    idx = torch.arange(2, device=DEV, dtype=torch.int32)
    with pytest.raises(ValueError, match="near's blocks"):
        dense_rows(q, kv, idx, idx + 120, [2], torch.zeros(2, 2, 8, dtype=torch.bool, device=DEV), block_size=16)
