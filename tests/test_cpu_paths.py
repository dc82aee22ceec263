"""The CPU's fast paths of the seam against the gathering references: the fused block-sparse prefill, the
dense causal prefill by GEMMs."""

from __future__ import annotations

import pytest
import torch

from raysparse.kernels import cpu_prefill
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



@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("n_q,n,block", [(700, 1500, 128), (1, 77, 128), (130, 130, 128), (300, 300, 64),
                                         (129, 1000, 128), (5, 9, 4)])
def test_cpu_causal_prefill_matches_reference(n_q, n, block, native, monkeypatch):
    """Every output element of the GEMM prefill against an fp64 masked softmax, with K/V strided as the cache's
    gather hands them (a slice of a longer page run) and query blocks that do not divide the chunk; with the
    C kernel's softmax and with PyTorch's (no compiler)."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    g = torch.Generator().manual_seed(seed)
    monkeypatch.setattr(cpu_prefill, "BLOCK", block)
    if not native:
        monkeypatch.setattr(cpu_prefill, "_softmax_rows", lambda *a: None)
    h, h_kv, d = 6, 2, 16
    q = torch.randn(n_q, h, d, generator=g) * 2
    k, v = (torch.randn(h_kv, n + 7, d, generator=g)[:, :n] for _ in range(2))
    assert cpu_prefill.supported(q, k, v)
    got = cpu_prefill.causal_attention_cpu(q, k, v, 0.3)
    s = torch.einsum("qhd,hkd->hqk", q.double(), k.double().repeat_interleave(h // h_kv, 0)) * 0.3
    s = s.masked_fill(torch.arange(n - n_q, n)[:, None] < torch.arange(n)[None], float("-inf"))
    want = torch.einsum("hqk,hkd->qhd", s.softmax(-1), v.double().repeat_interleave(h // h_kv, 0)).float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("n_q,n,d,b", [(700, 1500, 64, 64), (1, 77, 64, 64), (130, 130, 128, 64), (64, 64, 32, 16),
                                       (300, 1000, 64, 32), (190, 190, 64, 64)])
def test_cpu_block_prefill_kernel_matches_reference(n_q, n, d, b):
    """The C kernel's every output and lse element against the gathering reference, on random selections with
    the sink and diagonal forced, ragged fills, the specialised (d, block) and the generic copies; a query block
    that lists nothing causal gives zeros and -inf as the reference."""
    from raysparse.kernels import cpu_block_prefill

    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    h, h_kv = 6, 2
    q, k, v = (torch.randn(*s, generator=g) for s in ((n_q, h, d), (h_kv, n, d), (h_kv, n, d)))
    qb0 = (n - n_q) // b
    qb = torch.arange(qb0, (n - 1) // b + 1)[:, None]
    kb = torch.arange(-(-n // b))[None]
    mask = ((torch.rand(h_kv, qb.shape[0], kb.shape[1], generator=g) < 0.3) & (kb <= qb)) | (kb == qb) | (kb == 0)
    mask[1, -1] = False  # a (head, query block) with no key at all
    sel = BlockSelection(indices_from_mask(mask), b)
    want, want_lse = block_sparse_attention(q, k, v, sel)
    assert cpu_block_prefill.supported(q, k, v, sel.indices, b), "no C compiler: the kernel is not built"
    got, lse = cpu_block_prefill.block_sparse_prefill(q, k, v, sel.indices, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)), seed
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[fin], want_lse[fin], rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")

def _seed() -> int:
    seed = int(torch.randint(0, 2**31 - 1, ()))
    print(f"seed {seed}")
    return seed


def test_compact_matches_stable_sort_of_flags():
    """CIS's list from a mask (a running count) against the stable sort it replaced, every element, on random
    masks of every density, widths below and above the set count included."""
    from raysparse.methods.cis_batched import compact
    from raysparse.methods.selection import SENTINEL

    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    for n in (1, 7, 64, 300):
        for p in (0.0, 0.05, 0.5, 1.0):
            mask = torch.rand(3, 2, n, generator=g) < p
            for width in (1, 5, n, n + 3):
                flags, cols = mask.to(torch.uint8).sort(dim=-1, descending=True, stable=True)
                want = torch.where(flags > 0, cols, SENTINEL).to(torch.int32)
                want = torch.nn.functional.pad(want, (0, max(0, width - n)), value=SENTINEL)[..., :width]
                assert torch.equal(compact(mask, width), want), f"seed {seed}: n {n} p {p} width {width}"


def test_cis_retrieval_of_some_pairs_matches_all_pairs():
    """The CPU's CIS retrieval of the retrieving (row, KV head) pairs alone gives, for those pairs, the same
    entries as the fixed-shape retrieval of every pair (every element), and nothing valid for the others."""
    from raysparse.kernels.formats import PagedKV
    from raysparse.methods.cis_batched import _retrieve

    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    b, h_kv, grp, d, page, width = 3, 2, 3, 16, 8, 6
    k = torch.randn(20, h_kv, page, d, generator=g)
    table = torch.stack([torch.randperm(19, generator=g)[:width] for _ in range(b)]).to(torch.int32)
    n = torch.randint(1, width * page + 1, (b,), generator=g)
    kv = PagedKV(k, torch.randn_like(k), table, n.to(torch.int32))
    wt = width * page
    pos = torch.arange(wt)
    inrange = pos < n[:, None]
    allowed = inrange & (torch.rand(b, wt, generator=g) < 0.8)
    q = torch.randn(b, h_kv * grp, d, generator=g)
    want_order, want_ok = _retrieve(q, kv, wt, allowed, 11, None)
    for rows in (torch.rand(b, h_kv, generator=g) < 0.5, torch.ones(b, h_kv, dtype=torch.bool),
                 torch.zeros(b, h_kv, dtype=torch.bool)):
        order, ok = _retrieve(q, kv, wt, allowed, 11, rows)
        assert torch.equal(ok[rows], want_ok[rows]), f"seed {seed}"
        assert torch.equal(torch.where(ok, order, -1)[rows], torch.where(want_ok, want_order, -1)[rows]), f"seed {seed}"
        assert not ok[~rows].any(), f"seed {seed}"


@pytest.mark.parametrize("params", [
    {"density": 0.3, "sink": 2, "local": 3, "share_block": 3, "radius": 1, "threshold": 0.5},
    {"density": 0.5, "sink": 1, "local": 2, "share_block": 4, "radius": 2, "threshold": 0.7},
    {"density": 0.2, "sink": 4, "local": 4, "share_block": 2, "radius": 3, "threshold": 0.9},
    {"density": 0.4, "sink": 1, "local": 0, "share_block": 3, "radius": 2, "threshold": 0.6}])  # dilation past n
@pytest.mark.parametrize("psaw", [False, True])
def test_cis_listed_step_matches_ranked_step(params, psaw):
    """CIS's batched step by three list selections (the GPUs' path) against the ranked path (sorted top-k,
    ``priority_set``, ``compact``; the CPU's) over several steps of one ragged batch: every selected entry,
    the counts, and the stored anchor sets as sets, on steps where some pairs share and others retrieve."""
    from raysparse.kernels.formats import PagedKV
    from raysparse.methods.cis import CISConfig
    from raysparse.methods.cis_batched import CISRows, cis_batched_step, set_width

    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    cfg = CISConfig(**params)
    b, h_kv, grp, d, page, width = 3, 2, 2, 16, 8, 12
    k = torch.randn(b * width + 1, h_kv, page, d, generator=g)
    table = torch.randperm(b * width + 1, generator=g)[: b * width].view(b, width).to(torch.int32)
    steps, wt = 12, width * page
    n = torch.randint(page, wt - steps, (b,), generator=g)  # every row's keys fit the bucket at every step
    bufs = [CISRows(1, b, cfg, h_kv, grp * d, set_width(cfg, wt), torch.device("cpu")) for _ in range(2)]
    q = torch.randn(b, h_kv * grp, d, generator=g)
    mixed = 0
    for step in range(steps):
        kv = PagedKV(k, k, table, (n + step).to(torch.int32))
        lo = (n + step) // 3 if psaw else None
        outs = [cis_batched_step(cfg, buf, 0, q, kv, wt, lo, listed=lst)
                for buf, lst in zip(bufs, (True, False), strict=True)]
        assert torch.equal(outs[0], outs[1]), f"seed {seed} step {step}"
        assert torch.equal(bufs[0].counts, bufs[1].counts), f"seed {seed} step {step}"
        assert torch.equal(bufs[0].valid, bufs[1].valid), f"seed {seed} step {step}"
        ranked = bufs[1].sets.clone()
        ranked[ranked < 0] = torch.iinfo(torch.int32).max  # the ranked path keeps priority order: compare sorted
        listed = bufs[0].sets.clone()
        listed[listed < 0] = torch.iinfo(torch.int32).max
        assert torch.equal(listed.sort(-1).values, ranked.sort(-1).values), f"seed {seed} step {step}"
        # Half the pairs jump to a fresh query (they retrieve) and half barely move (they share the anchor set
        # of their last jump), alternating, so every step but a block's first mixes both.
        slow = (torch.arange(b * h_kv).view(b, h_kv, 1, 1) + step) % 2 == 0
        drift = q.view(b, h_kv, grp, d) + 0.01 * torch.randn(b, h_kv, grp, d, generator=g)
        q = torch.where(slow, drift, torch.randn(b, h_kv, grp, d, generator=g)).view(q.shape)
        mixed += 0 < int(bufs[0].counts[0, ..., 1].sum()) < b * h_kv
    assert mixed >= 6, f"seed {seed}: too few steps mixed sharing and retrieving pairs ({mixed})"


@pytest.mark.parametrize("tables,width,elems", [(60, 40, 1 << 18), (5, 3, 1 << 18), (13, 9, 3000), (60, 7, 1)])
def test_paged_collision_torch_matches_per_sequence_scores(tables, width, elems, monkeypatch):
    """SOCKET's paged CPU scorer (page chunks, every table at once) against the per-sequence reference
    scorer over each row's gathered bucket ids and norms: every element (sums in another order: within
    fp32 rounding), -inf past each row's length exactly."""
    from raysparse.kernels import paged_collision
    from raysparse.kernels.paged_collision import paged_collision_torch
    from raysparse.kernels.scorer_reference import collision_scores_reference

    monkeypatch.setattr(paged_collision, "_GATHER_ELEMS", elems)  # several page chunks at the small ones
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    b, h, page, planes = 3, 2, 16, 6
    pages = b * width + 2
    ids = torch.randint(0, 1 << planes, (pages + 1, h, tables, page), generator=g).to(torch.uint8)
    norms = torch.rand(pages + 1, h, page, generator=g)
    table = torch.randperm(pages, generator=g)[: b * width].view(b, width).to(torch.int32)
    lens = torch.randint(1, width * page + 1, (b,), generator=g).to(torch.int32)
    probs = torch.softmax(torch.randn(b, h, tables, 1 << planes, generator=g), -1)
    for nrm in (norms, None):
        got = paged_collision_torch(probs, ids, nrm, table, lens)
        for i in range(b):
            n = int(lens[i])
            rows = ids[table[i].long()].permute(1, 2, 0, 3).reshape(h, tables, -1)[..., :n]
            want = collision_scores_reference(probs[i], rows)
            if nrm is not None:
                want = want * nrm[table[i].long()].permute(1, 0, 2).reshape(h, -1)[:, :n]
            torch.testing.assert_close(got[i, :, :n], want, rtol=1e-6, atol=1e-7,
                                       msg=lambda m, seed=seed: f"seed {seed}: {m}")
            assert torch.isneginf(got[i, :, n:]).all(), f"seed {seed}"


def test_paged_collision_torch_forced_bias_sets_forced_and_past_tokens_exactly():
    """The forced sinks and windows (+inf) and the tokens past each row's length (-inf) come from one bias added to
    the scores; the other tokens keep their scores bit for bit. Sink counts above a row's length included: past
    the length wins. The step-built bias (``bias=``) gives the same tensor as ``forced=``."""
    from raysparse.kernels.paged_collision import forced_bias, paged_collision_torch

    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    b, h, page, tables, planes, width = 4, 2, 16, 7, 5, 6
    pages = b * width + 1
    ids = torch.randint(0, 1 << planes, (pages + 1, h, tables, page), generator=g).to(torch.uint8)
    norms = torch.rand(pages + 1, h, page, generator=g)
    table = torch.randperm(pages, generator=g)[: b * width].view(b, width).to(torch.int32)
    lens = torch.randint(1, width * page + 1, (b,), generator=g).to(torch.int32)
    lens[0] = 3  # shorter than its sinks
    sink = torch.randint(0, 24, (b,), generator=g)
    local = torch.randint(0, 24, (b,), generator=g)
    probs = torch.softmax(torch.randn(b, h, tables, 1 << planes, generator=g), -1)
    j = torch.arange(width * page)
    n = lens.long()[:, None]
    forced = ((j < sink[:, None]) | ((j >= n - local[:, None]) & (j < n)))[:, None].expand(b, h, -1)
    past = (j >= n)[:, None].expand(b, h, -1)
    for nrm in (norms, None):
        plain = paged_collision_torch(probs, ids, nrm, table, lens)
        got = paged_collision_torch(probs, ids, nrm, table, lens, (sink, local))
        built = paged_collision_torch(probs, ids, nrm, table, lens, bias=forced_bias((sink, local), lens, width * page))
        assert torch.equal(got, built), f"seed {seed}"
        assert torch.isneginf(got[past]).all() and torch.isposinf(got[forced & ~past]).all(), f"seed {seed}"
        keep = ~forced & ~past
        assert torch.equal(got[keep], plain[keep]) and torch.isfinite(got[keep]).all(), f"seed {seed}"


@pytest.mark.parametrize("d,page,unit,g,shared", [(64, 64, 64, 3, True), (64, 16, 16, 3, False),
                                                  (128, 16, 16, 4, False), (32, 8, 8, 1, True), (64, 64, 64, 8, False),
                                                  (64, 16, 4, 3, False), (64, 16, 1, 3, False)])
def test_cpu_decode_kernel_matches_gathered_oracle(d, page, unit, g, shared):
    """The C kernel's every output and lse element against the gathered fp32 oracle: pages scattered through
    the cache, ragged lengths (an empty row, one key, a part page), per-head lists with holes, entries of a
    page or of a part of one (tokens too), in shuffled order; spans of the list split across items."""
    from raysparse.kernels import cpu_decode
    from raysparse.kernels.formats import PagedKV
    from raysparse.kernels.paged_torch import paged_decode_fp32

    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    h_kv, pages = 2, 40
    lens = torch.tensor([0, 1, page + 3, 17 * page + 5, pages * page], dtype=torch.int32)
    b, width = lens.numel(), pages * page // unit
    cache_pages = b * pages + 7
    k, v = (torch.randn(cache_pages, h_kv, page, d, generator=gen) for _ in range(2))
    table = torch.randperm(cache_pages, generator=gen)[: b * pages].view(b, pages).int()
    used = -(-lens.long() // unit)
    cols = torch.arange(width)
    idx = torch.where(cols[None] < used[:, None], cols[None], -1)[:, None, :].expand(b, h_kv, width)
    if not shared:
        idx = torch.where(torch.rand(b, h_kv, width, generator=gen) < 0.4, -1, idx)
        idx = idx.gather(2, torch.argsort(torch.rand(b, h_kv, width, generator=gen), dim=2))
    idx = idx.int().contiguous()
    q = torch.randn(b, g * h_kv, d, generator=gen) * 2
    kv = PagedKV(k, v, table, lens, None)
    assert cpu_decode.supported(q, kv, unit), "no C compiler: the kernel is not built"
    got, lse = cpu_decode.paged_pages_decode(q, kv, idx, 0.2, shared=shared, unit=unit)
    want, want_lse = paged_decode_fp32(q, kv, idx, unit, 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)), seed
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[finite], want_lse[finite], rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")
