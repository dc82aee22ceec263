"""The batched seam's kernels against their PyTorch forms, on ragged paged batches: SOCKET's paged collision
scores and the split-K decode over token or block selections read through the page table. Without a GPU the
kernels run in Triton's interpreter (shapes stay small: it pays per program)."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV  # before raysparse.kernels: without a GPU it picks the interpreter

from raysparse.kernels.formats import PagedKV
from raysparse.kernels.paged_collision import paged_collision, paged_collision_torch
from raysparse.kernels.paged_torch import paged_decode_torch
from raysparse.kernels.selection import SENTINEL
from raysparse.kernels.sparse_decode import sparse_decode


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _table(g: torch.Generator, lens: list[int], page: int, width: int, pages: int) -> torch.Tensor:
    """Distinct random physical pages per row, the scratch page (``pages``) past each row's last page."""
    perm = torch.randperm(pages, generator=g)
    table = torch.full((len(lens), width), pages, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        m = -(-n // page)
        table[i, :m] = perm[used: used + m].to(torch.int32)
        used += m
    return table


def test_paged_collision_matches_torch():
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    page, pages, h, tables, planes = 16, 24, 2, 5, 4
    lens = [int(x) for x in torch.randint(1, 90, (3,), generator=g)]
    lens[0] = min(lens[0], 6)  # shorter than some sinks and windows
    table = _table(g, lens, page, 8, pages)
    ids = torch.randint(0, 1 << planes, (pages + 1, h, tables, page), generator=g, dtype=torch.int64).to(torch.uint8)
    norms = torch.rand(pages + 1, h, page, generator=g)
    probs = torch.softmax(torch.randn(3, h, tables, 1 << planes, generator=g), -1)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    sink = torch.randint(0, 20, (3,), generator=g)
    local = torch.randint(0, 20, (3,), generator=g)
    j = torch.arange(8 * page)
    n = seqlens.long()[:, None, None]
    forced_at = ((j < sink[:, None, None]) | (j >= n - local[:, None, None])) & (j < n)
    # Pages a program: 1, 2, 4 (two programs a row) and 16 (past the row's 8 pages); the tables unrolled or looped.
    cases = [(norms, probs, 1, True), (norms, probs.half(), 4, False), (None, probs, 16, True),
             (None, probs.half(), 2, False), (norms, probs, 2, False), (None, probs, 4, True)]
    for nrm, p_, per, unroll in cases:
        kn = {"pages_per_program": per, "unroll": unroll}
        want = paged_collision_torch(p_, ids, nrm, table, seqlens)
        args = [t.to(DEV) if t is not None else None for t in (p_, ids, nrm, table, seqlens)]
        got = paged_collision(*args, **kn)
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6, msg=lambda m, kn=kn: f"seed {seed} {kn}: {m}")
        # The forced sinks and windows come back as +inf, the rest as without them.
        forced = (sink.to(DEV), local.to(DEV))
        got_f = paged_collision(*args, forced=forced, **kn).cpu()
        want_f = paged_collision_torch(p_, ids, nrm, table, seqlens, (sink, local))
        assert torch.equal(torch.isposinf(want_f), forced_at.expand_as(want_f)), f"seed {seed}"
        assert torch.equal(torch.isposinf(got_f), forced_at.expand_as(got_f)), f"seed {seed}"
        torch.testing.assert_close(got_f[~forced_at.expand_as(got_f)], want[~forced_at.expand_as(want)],
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")


def _decode_case(g: torch.Generator, rows: int, max_len: int, width: int, pages: int, page: int = 16,
                 h_kv: int = 2, g_heads: int = 2, d: int = 16):
    """A ragged decode batch over scattered pages: lengths, page table, K, V pools, lengths tensor and q."""
    lens = [int(x) for x in torch.randint(1, max_len, (rows,), generator=g)]
    table = _table(g, lens, page, width, pages)
    k = torch.randn(pages + 1, h_kv, page, d, generator=g)
    v = torch.randn(pages + 1, h_kv, page, d, generator=g)
    q = torch.randn(rows, h_kv * g_heads, d, generator=g)
    return lens, table, k, v, torch.tensor(lens, dtype=torch.int32), q


def test_sparse_decode_paged_matches_torch():
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    h_kv = 2
    lens, table, k, v, seqlens, q = _decode_case(g, 3, 120, 8, 30)
    for unit in (1, 4, 16):
        width = 10
        sel = torch.full((3, h_kv, width), SENTINEL, dtype=torch.int32)
        for i, n in enumerate(lens):
            units = -(-n // unit)
            for hh in range(h_kv):
                m = int(torch.randint(1, min(units, width) + 1, (), generator=g))
                sel[i, hh, :m] = torch.randperm(units, generator=g)[:m].sort().values.to(torch.int32)
        want, want_lse = paged_decode_torch(q, PagedKV(k, v, table, seqlens), sel, unit)
        kv = PagedKV(k.to(DEV), v.to(DEV), table.to(DEV), seqlens.to(DEV))
        got, lse = sparse_decode(q.to(DEV), kv, sel.to(DEV), unit)
        tol = 1e-4 if DEV.type == "cpu" else 1e-2  # fp32 dots run as TF32 on GPUs (``dot_precision``)
        torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol, msg=lambda m: f"seed {seed}: {m}")
        torch.testing.assert_close(lse.cpu(), want_lse, rtol=tol, atol=tol, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("num_splits", [None, 1, 3, 7])
def test_sparse_decode_splits_share_a_padded_lists_entries(num_splits: int | None):
    """Lists padded past their entries (a dense list in a wider bucket, as a captured graph's is; here each KV head
    with its own count, from none to all): the splits share each row's valid prefix, and the output is the
    reference's whatever the split count."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    page = 16
    _, table, k, v, seqlens, q = _decode_case(g, 4, 150, 10, 40)
    width = 16  # wider than any row's pages: the padded tail holds no entry
    n_pages = (seqlens + page - 1) // page
    valid = torch.stack([n_pages, (n_pages * torch.rand(4, generator=g)).long()], 1)  # [rows, h_kv]
    valid[0, 1] = 0  # a KV head with an empty list
    cols = torch.arange(width, dtype=torch.int32)
    sel = torch.where(cols < valid[..., None], cols, SENTINEL).to(torch.int32)
    want, want_lse = paged_decode_torch(q, PagedKV(k, v, table, seqlens), sel, page)
    kv = PagedKV(k.to(DEV), v.to(DEV), table.to(DEV), seqlens.to(DEV))
    got, lse = sparse_decode(q.to(DEV), kv, sel.to(DEV), page, num_splits=num_splits)
    tol = 1e-4 if DEV.type == "cpu" else 1e-2  # fp32 dots run as TF32 on GPUs (``dot_precision``)
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=tol, atol=tol, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("page,width,rows,dtype", [
    (32, 6, 16, torch.float32),  # 4 Quest pages per cache page; 24 of them: two programs, the last partial
    (32, 11, None, torch.float32),  # 44 at the default tile: two programs, the last partial
    (32, 6, 64, torch.bfloat16),  # one program wider than the row (the GPU's dtype, up-cast on load)
    (24, 7, 16, torch.float32),  # 3 Quest pages per cache page: tiles that split a cache page
])
def test_paged_quest_scores_match_torch(page: int, width: int, rows: int | None, dtype: torch.dtype):
    from raysparse.kernels.paged_quest import paged_quest_scores, paged_quest_scores_torch

    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    qpage, pages, h_kv, g_heads, d = 8, 40, 2, 3, 16  # 3 query heads per KV head: not a power of two
    full = width * page
    mid = int(torch.randint(1, full // qpage, (), generator=g)) * qpage - int(torch.randint(1, qpage, (), generator=g))
    lens = [1, mid, full, int(torch.randint(1, full + 1, (), generator=g))]  # mid ends inside a Quest page
    table = _table(g, lens, page, width, pages)
    for i, n in enumerate(lens):  # past a row's pages the table may hold anything (stale pages of others)
        m = -(-n // page)
        table[i, m:] = torch.randint(0, pages + 1, (width - m,), generator=g, dtype=torch.int32)
    lo = torch.randn(pages + 1, h_kv, page // qpage, d, generator=g)
    hi = (lo + torch.rand(pages + 1, h_kv, page // qpage, d, generator=g)).to(dtype)
    lo, q = lo.to(dtype), torch.randn(len(lens), h_kv * g_heads, d, generator=g).to(dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    knobs = {} if rows is None else {"rows": rows}
    with_forced = None
    for forced in (True, False):  # Quest's encoding, and CIS's page retrieval's (the first and current pages scored)
        want = paged_quest_scores_torch(q, lo, hi, table, seqlens, qpage, forced)
        got = paged_quest_scores(*(t.to(DEV) for t in (q, lo, hi, table, seqlens)), qpage, forced, **knobs).cpu()
        assert got.shape == want.shape == (len(lens), h_kv, width * page // qpage), f"seed {seed}"
        inf = torch.isinf(want)
        assert torch.equal(torch.isinf(got), inf) and torch.equal(got[inf], want[inf]), f"seed {seed}"  # the encoding
        fin = torch.isfinite(want)
        assert int(fin.sum()) > 0 and torch.isfinite(got[fin]).all(), f"seed {seed}"
        torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")
        if forced:
            with_forced = want
    # Unforced, every page up to the row's last holds its bound (no +inf), and the rest are Quest's scores.
    n_pages = (seqlens.long() + qpage - 1) // qpage
    j = torch.arange(want.shape[-1])
    live = (j < n_pages[:, None])[:, None].expand_as(want)
    assert torch.isfinite(want[live]).all() and (want[~live] == -torch.inf).all(), f"seed {seed}"
    fin = torch.isfinite(with_forced)
    assert torch.equal(want[fin], with_forced[fin]), f"seed {seed}"


@pytest.mark.parametrize("width,g_heads", [(3, 3), (9, 4)])  # one chunk of pages; three, the last partial
def test_paged_group_probs_match_torch(width: int, g_heads: int):
    from raysparse.kernels.paged_probs import paged_group_probs, paged_group_probs_torch

    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    page, pages, h_kv, d = 16, 40, 2, 16
    lens = [int(x) for x in torch.randint(1, width * page + 1, (3,), generator=g)]
    table = _table(g, lens, page, width, pages)
    k = torch.randn(pages + 1, h_kv, page, d, generator=g).to(torch.bfloat16)
    kv = PagedKV(k, k, table, torch.tensor(lens, dtype=torch.int32))
    q = 3 * torch.randn(3, h_kv * g_heads, d, generator=g)
    need = torch.rand(3, h_kv, generator=g) < 0.6
    wt = min(width * page, max(lens) + int(torch.randint(0, page, (), generator=g)))  # a bucket wider than a row
    for mask in (need, None):
        want = paged_group_probs_torch(q, kv, wt, mask)
        dev_kv = PagedKV(*(t.to(DEV) for t in (kv.k, kv.v, kv.page_table, kv.seqlens)))
        got = paged_group_probs(q.to(DEV), dev_kv, wt, None if mask is None else mask.to(DEV)).cpu()
        assert got.shape == (3, h_kv, wt)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")
        if mask is not None:
            assert (got[~mask] == 0).all(), f"seed {seed}"  # a pair that needs none reads no key
        # each needed pair's probabilities sum to its group size over the row's keys, and are 0 past them
        rows = torch.ones(3, h_kv, dtype=torch.bool) if mask is None else mask
        sums = got.sum(-1)
        torch.testing.assert_close(sums[rows], torch.full_like(sums[rows], float(g_heads)), rtol=1e-4, atol=1e-4)
        past = torch.arange(wt) >= torch.tensor(lens)[:, None, None]
        assert (got[past.expand_as(got)] == 0).all(), f"seed {seed}"
        # The candidate form: the same probabilities inside each row's [lo, hi), -inf outside it and for the
        # pairs that need none (the normaliser still spans the whole row).
        lo = torch.randint(0, wt, (3,), generator=g)
        hi = torch.minimum(lo + torch.randint(0, wt, (3,), generator=g), torch.tensor(lens))
        cand = paged_group_probs(q.to(DEV), dev_kv, wt, None if mask is None else mask.to(DEV),
                                 (lo.to(DEV), hi.to(DEV))).cpu()
        want_cand = paged_group_probs_torch(q, kv, wt, mask, (lo, hi))
        pos = torch.arange(wt)
        inside = ((pos >= lo[:, None]) & (pos < hi[:, None]))[:, None, :] & rows[..., None]
        for x in (cand, want_cand):
            assert torch.equal(torch.isinf(x), ~inside) and (x[~inside] < 0).all(), f"seed {seed}"
        assert torch.equal(want_cand[inside], want[inside]), f"seed {seed}"
        torch.testing.assert_close(cand[inside], want[inside], rtol=1e-5, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")
        # The selection row (``keep`` sinks): +inf on the kept keys (sinks, and from max(hi, lo) up to n), the
        # candidates' probabilities for needed pairs, 0 inside the bounds for the others, -inf elsewhere.
        keep = int(torch.randint(0, 5, (), generator=g))
        sel = paged_group_probs(q.to(DEV), dev_kv, wt, None if mask is None else mask.to(DEV),
                                (lo.to(DEV), hi.to(DEV)), keep=keep).cpu()
        want_sel = paged_group_probs_torch(q, kv, wt, mask, (lo, hi), keep=keep)
        n = torch.tensor(lens)[:, None]
        kept = ((pos < n) & ((pos < keep) | (pos >= torch.maximum(hi, lo)[:, None])))[:, None, :].expand_as(sel)
        zero = ((pos >= lo[:, None]) & (pos < hi[:, None]))[:, None, :] & ~rows[..., None] & ~kept
        for x in (sel, want_sel):
            assert torch.equal(x == float("inf"), kept), f"seed {seed}"
            assert (x[zero] == 0).all() and (x[~kept & ~zero & ~inside] == float("-inf")).all(), f"seed {seed}"
        got_in = inside & ~kept
        assert torch.equal(want_sel[got_in], want[got_in]), f"seed {seed}"
        torch.testing.assert_close(sel[got_in], want[got_in], rtol=1e-5, atol=1e-6, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("scatter", ["in_order", "runs", "scattered"])
def test_dense_decode_in_place_matches_the_gathered_form(scatter: str):
    """The CPU's dense decode, reading runs of consecutive pages in place, against the gathered fp32 form over
    every page, on a ragged batch (an empty row, a partial last page, one page) whose pages lie in order, in a few
    runs, or scattered past the in-place limit."""
    from raysparse.kernels.paged_torch import page_runs, paged_decode_fp32, paged_dense_decode_cpu

    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    page, h_kv, grp, d = 8, 3, 3, 16
    lens = [0, 75, 8, 130, 1]
    pages = 64
    width = max(-(-n // page) for n in lens)
    table = torch.full((len(lens), width), pages, dtype=torch.int32)
    order = torch.randperm(pages, generator=g)
    used = 0
    for i, n in enumerate(lens):
        m = -(-n // page)
        if scatter == "in_order":
            row = torch.arange(used, used + m)
        elif scatter == "runs":  # two or three runs of consecutive pages
            cut = m // 2
            row = torch.cat([torch.arange(40 - cut, 40), torch.arange(used, used + m - cut)])
        else:
            row = order[used: used + m]
        table[i, :m] = row.to(torch.int32)
        used += m
    k = torch.randn(pages + 1, h_kv, page, d, generator=g)
    v = torch.randn(pages + 1, h_kv, page, d, generator=g)
    q = torch.randn(len(lens), h_kv * grp, d, generator=g)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    if scatter == "scattered":
        assert len(page_runs(table[3, : -(-lens[3] // page)].tolist())) > 8, f"seed {seed}"
    kv = PagedKV(k, v, table, seqlens)
    blocks = torch.arange(width, dtype=torch.int32)[None, None, :].expand(len(lens), h_kv, -1).clone()
    past = torch.arange(width)[None, None, :].expand_as(blocks) >= (-(-seqlens.long() // page))[:, None, None]
    blocks[past] = SENTINEL
    want, want_lse = paged_decode_fp32(q, kv, blocks, page)
    got, lse = paged_dense_decode_cpu(q, kv)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")
    assert (got[0] == 0).all() and torch.isneginf(lse[0]).all(), f"seed {seed}"
    alone, none = paged_dense_decode_cpu(q, kv, want_lse=False)  # the output alone, as the dense decode asks
    assert none is None and torch.equal(alone, got), f"seed {seed}"


def test_page_runs():
    assert page_runs_of([5, 6, 7, 2, 3, 9]) == [(0, 5, 3), (3, 2, 2), (5, 9, 1)]
    assert page_runs_of([]) == []


def page_runs_of(pages: list[int]) -> list[tuple[int, int, int]]:
    from raysparse.kernels.paged_torch import page_runs

    return page_runs(pages)
