"""``kernels/row_select.py``: the PyTorch form and the host form against a plain per-row stable sort, and
both Triton paths (one program per row; the multi-program radix path, forced with a small chunk) against the
PyTorch form, bit for bit. Scores carry many exact ties (a small integer set, +-0.0), forced (+inf) and
excluded (-inf) entries, rows with fewer candidates than kk, kk = 0, kk above k_max, truncated lists and widths
that are no multiple of the chunk. Without a GPU the kernels run in Triton's interpreter (shapes stay small: it
pays per program). Outputs start as a sentinel, so every element must be written."""

from __future__ import annotations

import math

import pytest
import torch
from triton_env import DEV  # before raysparse.kernels: without a GPU it picks the interpreter

from raysparse.kernels.row_select import select_list, select_list_host, select_list_torch, select_list_triton

INF = float("inf")


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _python(score: torch.Tensor, kk: torch.Tensor, k_max: int, out_width: int) -> torch.Tensor:
    """The contract row by row: forced columns plus the first kk of a stable descending sort of the finite
    scores (Python's sort is stable and -0.0 == 0.0), ascending, truncated, -1 padded."""
    rows = []
    for vals, k in zip(score.tolist(), kk.tolist(), strict=True):
        forced = [j for j, v in enumerate(vals) if v == INF]
        cand = [j for j, v in enumerate(vals) if math.isfinite(v)]
        ranked = sorted(cand, key=lambda j: -vals[j])
        take = sorted(forced + ranked[: min(max(k, 0), k_max, len(cand))])[:out_width]
        rows.append(take + [-1] * (out_width - len(take)))
    return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), out_width)


def _scores(g: torch.Generator, rows: int, n: int, kind: str) -> torch.Tensor:
    if kind == "ties":  # a handful of values: long runs of exact ties at the threshold
        s = torch.randint(-3, 4, (rows, n), generator=g).float()
        neg_zero = (s == 0) & (torch.rand(rows, n, generator=g) < 0.5)
        s = torch.where(neg_zero, torch.full_like(s, -0.0), s)
    elif kind == "spread":  # every exponent range and sign, denormals and the extremes included
        s = torch.randn(rows, n, generator=g) * torch.exp2(torch.randint(-140, 120, (rows, n), generator=g).float())
        s.view(-1)[:: 7] = torch.finfo(torch.float32).max
        s.view(-1)[3:: 11] = -torch.finfo(torch.float32).max
        s.view(-1)[5:: 13] = torch.finfo(torch.float32).tiny / 8
    else:  # "normal": attention-like logits, some repeated
        s = torch.randn(rows, n, generator=g)
        s.view(-1)[::5] = s.view(-1)[1::5][: s.view(-1)[::5].numel()]
    u = torch.rand(rows, n, generator=g)
    s[u < 0.05] = INF
    s[(u >= 0.05) & (u < 0.2)] = -INF
    if rows > 1:  # a sparse row: fewer candidates than most kk
        s[1, torch.rand(n, generator=g) < 0.9] = -INF
    if rows > 2:  # a row of forced entries and exclusions only
        s[2] = torch.where(torch.rand(n, generator=g) < 0.3, INF, -INF)
    return s


def _kk(g: torch.Generator, rows: int, k_max: int, dtype: torch.dtype) -> torch.Tensor:
    kk = torch.randint(0, k_max + 1, (rows,), generator=g)
    kk[0] = 0
    if rows > 3:
        kk[3] = k_max + 5  # above k_max: clamped to it
    return kk.to(dtype)


CASES = [  # rows, n, k_max, out_width (None: forced max + k_max)
    (4, 37, 12, None),
    (5, 200, 60, None),
    (4, 300, 300, None),
    (6, 129, 40, 20),  # truncated rows
]


@pytest.mark.parametrize("kind", ["ties", "spread", "normal"])
def test_torch_matches_python(kind):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    for rows, n, k_max, width in CASES:
        s = _scores(g, rows, n, kind)
        kk = _kk(g, rows, k_max, torch.int64)
        w = width or int((s == INF).sum(1).max()) + k_max
        want = _python(s, kk, k_max, w)
        got = select_list_torch(s, kk, k_max, w)
        assert torch.equal(got, want), f"seed {seed}: {kind} {rows}x{n} k_max={k_max}"
        got = select_list_host(s, kk, k_max, w)
        assert torch.equal(got, want), f"seed {seed}: host form, {kind} {rows}x{n} k_max={k_max}"


def _check_triton(seed: int, kind: str, rows: int, n: int, k_max: int, width: int | None, **kw) -> None:
    g = torch.Generator().manual_seed(seed)
    s = _scores(g, rows, n, kind)
    kk = _kk(g, rows, k_max, torch.int32 if seed % 2 else torch.int64)
    w = width or int((s == INF).sum(1).max()) + k_max
    want = select_list_torch(s, kk, k_max, w)
    out = torch.full((rows, w), -7, dtype=torch.int32, device=DEV)
    got = select_list_triton(s.to(DEV), kk.to(DEV), k_max, w, out=out, **kw)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got.cpu(), want), f"seed {seed}: {kind} {rows}x{n} k_max={k_max} width={w} {kw}"


@pytest.mark.parametrize("kind", ["ties", "spread", "normal"])
@pytest.mark.parametrize("rows,n,k_max,width", CASES)
def test_single_program_matches_torch(kind, rows, n, k_max, width):
    _check_triton(_seed(), kind, rows, n, k_max, width)


@pytest.mark.parametrize("variant", [{}, {"bits": (11, 11, 10), "local_hist": False}], ids=["default", "11-11-10"])
@pytest.mark.parametrize("kind", ["ties", "spread", "normal"])
@pytest.mark.parametrize("rows,n,k_max,width,chunk", [
    (4, 37, 12, None, 16),  # 3 chunks, the last partial
    (5, 200, 60, None, 32),
    (4, 300, 300, None, 64),
    (6, 129, 40, 20, 16),  # truncated rows
    (2, 64, 64, None, 64),  # one chunk per row
])
def test_multi_program_matches_torch(kind, rows, n, k_max, width, chunk, variant):
    _check_triton(_seed(), kind, rows, n, k_max, width, single_max=0, chunk=chunk, **variant)


@pytest.mark.parametrize("multi", [False, True], ids=["single", "multi"])
def test_corner_rows(multi):
    """kk = 0 everywhere, k_max = 0, all-equal rows, one candidate, widths past the list, a 1-column row."""
    kw = {"single_max": 0, "chunk": 16} if multi else {}
    n = 50
    cases = []
    s = torch.zeros(3, n)
    s[1, ::2] = -0.0
    s[2, 10] = INF
    cases.append((s, torch.zeros(3, dtype=torch.long), 8, 12))  # kk = 0: forced only
    cases.append((s, torch.full((3,), 7), 0, 3))  # k_max = 0
    cases.append((s, torch.tensor([7, 49, 50]), 50, 60))  # all ties: the lowest columns win
    t = torch.full((2, n), -INF)
    t[0, 33] = 1.5
    t[1, :] = INF
    cases.append((t, torch.tensor([4, 4]), 4, n + 4))  # one candidate; every entry forced
    cases.append((torch.tensor([[2.0], [-INF]]), torch.tensor([1, 1]), 1, 2))
    for score, kk, k_max, w in cases:
        want = _python(score, kk, k_max, w)
        assert torch.equal(select_list_torch(score, kk, k_max, w), want)
        assert torch.equal(select_list_host(score, kk, k_max, w), want)
        if multi and score.shape[1] < 16:
            kw = {"single_max": 0, "chunk": 16}
        got = select_list_triton(score.to(DEV), kk.to(DEV), k_max, w, **kw)
        assert torch.equal(got.cpu(), want), (score, kk, k_max, w)


def test_dispatch(monkeypatch):
    """``select_list`` follows RAYSPARSE_KERNELS: the reference under ``torch``, Triton under ``triton``."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    s = _scores(g, 3, 90, "ties").to(DEV)
    kk = torch.tensor([5, 30, 9], device=DEV)
    want = select_list_torch(s.cpu(), kk.cpu(), 30, 40)
    for mode in ("torch", "triton"):
        monkeypatch.setenv("RAYSPARSE_KERNELS", mode)
        assert torch.equal(select_list(s, kk, 30, 40).cpu(), want), f"seed {seed}: {mode}"


@pytest.mark.parametrize("n", [90, 3000])  # the one-program path and the multi-program one
def test_triton_reads_a_broadcast_kk(n: int):
    """Per-row budgets often come as a broadcast view (one budget per sequence expanded over its KV heads:
    at one sequence, a stride-0 vector): every row must get its own, not what lies past the first."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    s = _scores(g, 3, n, "ties")
    kk = torch.tensor([[7]], device=DEV).expand(-1, 3).flatten()
    assert kk.stride() == (0,)  # the case: a view, not a copy
    want = select_list_torch(s, kk.cpu().contiguous(), 30, 40)
    got = select_list_triton(s.to(DEV), kk, 30, 40)
    assert torch.equal(got.cpu(), want), f"seed {seed}"


def test_rejects_bad_shapes():
    s = torch.zeros(2, 8)
    with pytest.raises(ValueError):
        select_list_torch(s.double(), torch.zeros(2, dtype=torch.long), 1, 2)
    with pytest.raises(ValueError):
        select_list_torch(s, torch.zeros(3, dtype=torch.long), 1, 2)
    with pytest.raises(ValueError):
        select_list_triton(s.to(DEV), torch.zeros(2, dtype=torch.long, device=DEV), 1, 2, single_max=0, chunk=24)
    with pytest.raises(ValueError):
        select_list_triton(s.to(DEV), torch.zeros(2, dtype=torch.long, device=DEV), 1, 2, single_max=0,
                           bits=(8, 8, 8))
