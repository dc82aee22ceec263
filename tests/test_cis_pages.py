"""CIS's page retrieval (``retrieval="pages"``) against a plain loop of its rule on fresh random inputs: pages by
Quest's upper bound, then the exact top keys within them (``raysparse/methods/cis_pages.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from raysparse.kernels.dispatch import update_quest_bounds
from raysparse.kernels.formats import PagedKV
from raysparse.methods.cis import CISConfig, cis_step, page_budget
from raysparse.methods.cis_pages import paged_pages_top, seq_pages_top
from raysparse.methods.registry import check_param_values, create_backend
from raysparse.methods.selection import SENTINEL


def _seed() -> int:
    return int(torch.randint(0, 1 << 30, ()))


def brute_pages_top(q: torch.Tensor, k: torch.Tensor, a: int, b: int, forced: set[int], kk: int, pages: int,
                    page: int) -> list[list[int]]:
    """The rule written out per KV head in float64: the candidate pages (those meeting [a, b)) by the largest
    over the group of sum_d max(q_d min_d, q_d max_d), ties to the lower page; the top ``pages``; then the
    candidates inside them by their group-summed softmax over those candidates and the forced keys, ties to the
    lower key; the first ``kk``."""
    h_kv, n, d = k.shape
    g = q.shape[0] // h_kv
    out = []
    for h in range(h_kv):
        kh, qs = k[h].double(), q[h * g:(h + 1) * g].double()
        scored = []
        for j in range(-(-n // page)):
            if not (j * page < b and (j + 1) * page > a):
                continue
            keys = kh[j * page: min((j + 1) * page, n)]
            lo, hi = keys.amin(0), keys.amax(0)
            bound = max(float(torch.maximum(qg * lo, qg * hi).sum()) for qg in qs)
            scored.append((-bound, j))
        chosen = [j for _, j in sorted(scored)[:pages]]
        cands = [t for j in chosen for t in range(j * page, (j + 1) * page) if a <= t < b and t < n]
        read = sorted(set(cands) | forced)
        prob = {t: 0.0 for t in read}
        for qg in qs:
            logits = torch.stack([kh[t] @ qg for t in read]) / math.sqrt(d)
            for t, p in zip(read, torch.softmax(logits, 0).tolist(), strict=True):
                prob[t] += p
        out.append(sorted(cands, key=lambda t: (-prob[t], t))[:kk])
    return out


@pytest.mark.parametrize("n,sink,local,page,kk,factor,lo", [
    (203, 16, 64, 16, 30, 2.0, 0),  # the defaults' shape: the first and current pages hold no candidate
    (150, 5, 7, 8, 12, 1.0, 0),  # sink and local inside a page: the first and current pages are candidates
    (97, 3, 4, 16, 40, 3.0, 41),  # a window bound inside a page (PSAW)
    (60, 2, 3, 8, 100, 2.0, 0),  # k past the candidates: every candidate page taken
])
def test_seq_pages_top_is_the_rule(n, sink, local, page, kk, factor, lo):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    h_kv, grp, d = 3, 2, 16
    k = torch.randn(h_kv, n, d, generator=g)
    q = torch.randn(h_kv * grp, d, generator=g)
    a, b = max(sink, lo), n - local
    pages = math.ceil(factor * kk / page)
    pos = torch.arange(n)
    forced_mask = ((pos < sink) | (pos >= n - local)) & ((pos < sink) | (pos >= lo))
    got = seq_pages_top(q, k, a, b, forced_mask, kk, pages, page)
    want = brute_pages_top(q, k, a, b, set(pos[forced_mask].tolist()), kk, pages, page)
    assert got.shape == (h_kv, kk), f"seed {seed}"
    rows = [[t for t in row if t != SENTINEL] for row in got.tolist()]
    assert rows == want, f"seed {seed}"
    for row, w in zip(got.tolist(), want, strict=True):  # each head's keys first, then padding alone
        assert row[:len(w)] == w and all(t == SENTINEL for t in row[len(w):]), f"seed {seed}"


def _paged(g: torch.Generator, keys: list[torch.Tensor], cp: int, width: int) -> tuple[PagedKV, int]:
    """The rows' keys [h_kv, n, d] in a paged cache of ``cp``-token pages, shuffled physical pages (stale keys
    elsewhere), a page table ``width`` pages wide."""
    h_kv, _, d = keys[0].shape
    num = sum(-(-x.shape[1] // cp) for x in keys) + 3
    k_pages = torch.randn(num + 1, h_kv, cp, d, generator=g) * 5  # stale: never a row's key
    perm = torch.randperm(num, generator=g).tolist()
    table = torch.full((len(keys), width), num, dtype=torch.int32)
    for i, x in enumerate(keys):
        for j in range(-(-x.shape[1] // cp)):
            pg = perm.pop()
            table[i, j] = pg
            chunk = x[:, j * cp:(j + 1) * cp]
            k_pages[pg, :, : chunk.shape[1]] = chunk
    lens = torch.tensor([x.shape[1] for x in keys], dtype=torch.int32)
    return PagedKV(k_pages, k_pages, table, lens), num


@pytest.mark.parametrize("sink,local,page,cp,factor,windowed", [
    (16, 32, 16, 32, 2.0, False),
    (3, 5, 8, 32, 1.0, True),  # the first and current pages are candidates; PSAW window bounds
    (4, 8, 16, 64, 1.5, True),
])
def test_paged_pages_top_matches_the_rule_on_a_ragged_batch(sink, local, page, cp, factor, windowed):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    h_kv, grp, d = 2, 3, 16
    lens = [int(x) for x in torch.randint(20, 300, (4,), generator=g)] + [sink + local]  # one with no candidate
    width = -(-max(lens) // cp) + 1  # a bucket wider than the longest row
    keys = [torch.randn(h_kv, n, d, generator=g) for n in lens]
    kv, num = _paged(g, keys, cp, width)
    # The bounds as the engine keeps them: every token's page recomputed up to it (each page's last token last).
    sub = cp // page
    lo_pool = torch.zeros(num + 1, h_kv, sub, d)
    hi_pool = torch.zeros(num + 1, h_kv, sub, d)
    pg = torch.cat([kv.page_table[i, torch.arange(n) // cp].long() for i, n in enumerate(lens)])
    off = torch.cat([torch.arange(n) % cp for n in lens])
    update_quest_bounds(kv.k, lo_pool, hi_pool, pg, off, page)
    q = torch.randn(len(lens), h_kv * grp, d, generator=g)
    n = kv.seqlens.long()
    vis = (n * torch.rand(len(lens), generator=g) * 0.6).long() if windowed else None
    a = n.new_full(n.shape, sink) if vis is None else vis.clamp(min=sink)
    b = n - local
    k_rows = torch.randint(0, 40, (len(lens),), generator=g)
    k = int(k_rows.max())
    cfg = CISConfig(retrieval="pages", retrieval_page=page, page_factor=factor)
    pages_rows = torch.tensor([page_budget(cfg, int(x)) for x in k_rows])
    need = torch.rand(len(lens), h_kv, generator=g) < 0.7
    need[0] = True
    wt = width * cp
    for rows in (need, None):
        order, ok = paged_pages_top(q, kv, (lo_pool, hi_pool), wt, page, a, b, sink, local, vis, k, k_rows,
                                    page_budget(cfg, k), pages_rows, rows)
        assert order.shape == ok.shape == (len(lens), h_kv, k), f"seed {seed}"
        for i, ni in enumerate(lens):
            lo_i = 0 if vis is None else int(vis[i])
            pos = range(ni)
            forced = {t for t in pos if t < sink or (t >= ni - local and t >= lo_i)}
            want = brute_pages_top(q[i], keys[i], int(a[i]), int(b[i]), forced, int(k_rows[i]), int(pages_rows[i]),
                                   page)
            for h in range(h_kv):
                got = order[i, h][ok[i, h]].tolist()
                if rows is not None and not bool(rows[i, h]):
                    assert got == [], f"seed {seed} row {i} head {h}: a sharing pair retrieved"
                else:
                    assert got == want[h], f"seed {seed} row {i} head {h}"
                    assert bool(ok[i, h, : len(got)].all()), f"seed {seed} row {i} head {h}: valid entries first"


def test_cis_step_pages_reads_the_rule():
    """``cis_step`` with ``retrieval="pages"`` and no sharing (threshold > 1): every step attends sinks + the
    rule's top-k + local."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    h_kv, grp, d = 2, 2, 16
    cfg = CISConfig(retrieval="pages", retrieval_page=8, page_factor=1.5, sink=3, local=5, topk=9, threshold=2.0)
    state: dict = {}
    k_all = torch.randn(h_kv, 120, d, generator=g)
    for n in range(90, 96):
        q = torch.randn(h_kv * grp, d, generator=g)
        k = k_all[:, :n]
        mask, retrieved, _ = cis_step(cfg, state, q, k)
        assert bool(retrieved.all()), f"seed {seed}"
        fixed = set(range(3)) | set(range(n - 5, n))
        want = brute_pages_top(q, k, 3, n - 5, fixed, 9, page_budget(cfg, 9), 8)
        for h in range(h_kv):
            assert sorted(mask[h].nonzero().squeeze(1).tolist()) == sorted(fixed | set(want[h])), f"seed {seed} n {n}"


def test_pages_equal_exact_when_the_pages_hold_every_candidate():
    """With as many pages as there are, the page retrieval reads every key (the candidates and the forced keys,
    with no window): the exact retrieval's probabilities, so its sets, anchors and sharing, step by step."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    h_kv, d = 3, 16
    grp = 2
    exact = CISConfig(sink=4, local=6, topk=20, threshold=0.3, share_block=4)
    pages = CISConfig(sink=4, local=6, topk=20, threshold=0.3, share_block=4, retrieval="pages", retrieval_page=8,
                      page_factor=100.0)
    k_all = torch.randn(h_kv, 140, d, generator=g)
    base = torch.randn(h_kv * grp, d, generator=g)
    s_exact: dict = {}
    s_pages: dict = {}
    for n in range(100, 112):
        q = base + 0.7 * torch.randn(h_kv * grp, d, generator=g)
        got = cis_step(pages, s_pages, q, k_all[:, :n])
        want = cis_step(exact, s_exact, q, k_all[:, :n])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"seed {seed} n {n}"


def test_retrieval_is_a_validated_method_param():
    from raysparse.config import ModelConfig

    cfg = ModelConfig(97, 96, 80, 4, 6, 2, 16, 1e-5, 4096, False)
    backend = create_backend("cis", cfg, retrieval="pages", retrieval_page=32, page_factor=3)
    assert (backend.config.retrieval, backend.config.retrieval_page, backend.config.page_factor) == ("pages", 32, 3)
    assert create_backend("cis", cfg).config.retrieval == "exact"
    assert create_backend("cpe", cfg, retrieval="pages").config.retrieval == "pages"
    check_param_values("cis", {"retrieval": "pages", "page_factor": 2.5})
    for bad in ({"retrieval": "approx"}, {"retrieval_page": 12}, {"retrieval_page": 128}, {"page_factor": 0.5}):
        with pytest.raises(ValueError):
            create_backend("cis", cfg, **bad)
    with pytest.raises(ValueError, match="retrieval"):
        check_param_values("cis", {"retrieval": 1})
    with pytest.raises(ValueError):
        create_backend("psaw", cfg, retrieval="pages")  # PSAW has no retrieval
