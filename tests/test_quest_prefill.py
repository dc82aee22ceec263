"""Quest's batched prefill scores (``kernels/quest_prefill.py``: the Triton kernel and its PyTorch form) against
the per-sequence reference (``Quest._prefill_scores`` over each sequence's gathered keys), and the packed
selection of ``Quest.prefill_select`` against the per-sequence ``select_prefill``: ragged batches on shuffled
pages, partial last pages, a second chunk on top of cached keys, fp32 and bf16 bounds. Without a GPU the
kernel runs in Triton's interpreter (small shapes: it pays per program)."""

from __future__ import annotations

import math

import pytest
import torch
from triton_env import DEV  # before raysparse.kernels: without a GPU it picks the interpreter

from raysparse.config import ModelConfig
from raysparse.kernels.formats import pack_block_selections
from raysparse.kernels.quest_prefill import quest_prefill_scores, quest_prefill_scores_torch
from raysparse.kernels.scorer_reference import page_bounds
from raysparse.kv_cache import KVCache
from raysparse.methods.quest import Quest, QuestConfig
from raysparse.methods.views import PrefillView

H_KV, G, LAYER = 2, 3, 2  # 3 query heads per KV head: not a power of two


def _seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def _steps(seed: int, block: int, qpage: int, cpage: int, dtype: torch.dtype, d: int = 16, density: float = 0.3):
    """A Quest instance and a cache holding three ragged prompts on shuffled pages, prefilled in two chunks
    (the second starting mid-block and mid-page on top of the first's cached keys); yields (quest, cache, batch,
    q) after each step, the step's keys written and the bound pools brought up to date."""
    g = torch.Generator().manual_seed(seed)
    cfg = ModelConfig(97, H_KV * G * d, 80, 3, H_KV * G, H_KV, d, 1e-5, 4096, False)
    quest = Quest(cfg, QuestConfig(density=density, block_size=block, page_size=qpage))
    lens = [int(torch.randint(90, 120, (), generator=g))] + [int(x) for x in torch.randint(2, 80, (2,), generator=g)]
    first = [int(torch.randint(1, n, (), generator=g)) for n in lens]
    n_pages = sum(-(-n // cpage) for n in lens) + 3
    cache = KVCache(cfg, num_pages=n_pages, page_size=cpage, dtype=dtype, device=DEV, num_kv_heads=H_KV)
    for pool, stale in zip(quest._pools(LAYER, cache), (-40.0, 40.0), strict=True):
        pool.fill_(stale)  # a former tenant's wide bounds: a Quest page past n that is read scores high
    perm, used = torch.randperm(n_pages, generator=g).tolist(), 0
    for sid, n in enumerate(lens):
        m = -(-n // cpage)
        cache.attach(sid, perm[used: used + m], n)
        used += m
    for chunk in (first, [n - f for n, f in zip(lens, first, strict=True)]):
        batch = cache.prepare([0, 1, 2], chunk, True)
        t = sum(chunk)
        k = (torch.randn(t, H_KV, d, generator=g) * 1.5 - 0.2).to(dtype)
        cache.write(LAYER, k.to(DEV), torch.zeros_like(k).to(DEV), batch)
        quest.update_state(LAYER, cache, batch)
        q = (torch.randn(t, H_KV * G, d, generator=g) * 1.5 + 0.3).to(dtype).to(DEV)
        yield quest, cache, batch, q


def _args(quest: Quest, cache: KVCache, batch, q: torch.Tensor):
    view = PrefillView.of(LAYER, batch, cache)
    b = quest.config.block_size
    rows = view.qblocks(b)
    lo, hi = quest._pools(LAYER, cache)
    nkb = -(-max(batch.ctx_lens) // b)
    return view, (q, lo, hi, view.kv.page_table, view.kv.seqlens, view.cu_q_dev, rows.seq, rows.qblock, b,
                  quest.config.page_size, nkb)


@pytest.mark.parametrize("block,qpage,cpage,dtype,d,knobs", [
    (16, 4, 16, torch.float32, 16, {}),  # the runtime's layout: a cache page is a block; row tiles span sequences
    (16, 4, 16, torch.bfloat16, 16, {}),  # the GPU's dtype, up-cast on load
    (16, 16, 16, torch.bfloat16, 24, {"rows": 4, "pages": 16, "dk": 16}),  # dots; one Quest page a block; d not 2^k
    (16, 4, 16, torch.bfloat16, 16, {"precision": "fma"}),  # the exact FMAs
    (32, 8, 16, torch.float32, 16, {"rows": 1, "pages": 4, "precision": "fma"}),  # one block, one row a program
    (16, 16, 16, torch.bfloat16, 24, {"rows": 2, "pages": 2, "dk": 16, "precision": "fma"}),
    (32, 4, 32, torch.float32, 16, {"pages": 16, "precision": "fma"}),  # 8 Quest pages a block, two blocks a program
])
def test_scores_match_the_per_sequence_reference(block, qpage, cpage, dtype, d, knobs):
    seed = _seed()
    for step, (quest, cache, batch, q) in enumerate(_steps(seed, block, qpage, cpage, dtype, d)):
        view, args = _args(quest, cache, batch, q)
        want = quest_prefill_scores_torch(*args).cpu()
        got = quest_prefill_scores(*args, **knobs).cpu()
        rows = view.qblocks(block)
        assert got.shape == want.shape == (H_KV, rows.seq.numel(), args[-1]), f"seed {seed}"
        qb, kb = rows.qblock.cpu(), torch.arange(args[-1])
        causal = (kb[None, :] <= qb[:, None]).expand_as(want)
        msg = f"seed {seed}, step {step}"
        # past each row's diagonal both are -inf (the contract); inside it every entry is finite
        assert (want[~causal] == -math.inf).all() and (got[~causal] == -math.inf).all(), msg
        assert torch.isfinite(want[causal]).all() and torch.isfinite(got[causal]).all(), msg
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, msg=lambda m, msg=msg: f"{msg}: {m}")
        start = rows.start.tolist()
        for i, n in enumerate(batch.ctx_lens):
            # the reference: the sequence's gathered keys, bounds from them, the per-sequence scoring
            k, _ = cache.gather(LAYER, batch, i)
            lo, hi = page_bounds(k, qpage)
            cq = q[batch.cu_q[i]: batch.cu_q[i + 1]]
            ref, ref_qb = quest._prefill_scores(view.context(i, {}), cq, lo.float(), hi.float())
            ref, nkb = ref.cpu(), -(-n // block)
            assert torch.equal(qb[start[i]: start[i + 1]], ref_qb.cpu()), msg
            sl, c = slice(start[i], start[i + 1]), causal[:, start[i]: start[i + 1], :nkb]
            assert torch.equal(want[:, sl, :nkb][c], ref[c]), msg  # the same ops: bit-equal
            torch.testing.assert_close(got[:, sl, :nkb][c], ref[c], rtol=1e-5, atol=1e-4,
                                       msg=lambda m, i=i, msg=msg: f"{msg}, sequence {i}: {m}")


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("block,qpage,dtype,density", [(16, 4, torch.float32, 0.3), (32, 8, torch.bfloat16, 0.15)])
def test_packed_selection_equals_per_sequence_selections(monkeypatch, kernels, block, qpage, dtype, density):
    """``prefill_select`` (the pools, one top-k over the packed rows) selects what ``select_prefill`` does per
    sequence from its gathered keys, entry for entry."""
    monkeypatch.setenv("RAYSPARSE_KERNELS", kernels)
    seed = _seed()
    for step, (quest, cache, batch, q) in enumerate(_steps(seed, block, qpage, block, dtype, density=density)):
        view = PrefillView.of(LAYER, batch, cache)
        got = quest.prefill_select(LAYER, q, view)
        sels = []
        for i in range(len(batch.seq_ids)):
            k, v = cache.gather(LAYER, batch, i)
            sels.append(quest.select_prefill(view.context(i, {}), q[batch.cu_q[i]: batch.cu_q[i + 1]], k, v))
        want = pack_block_selections(sels)
        msg = f"seed {seed}, step {step}"
        assert torch.equal(got.indices.cpu(), want.indices.cpu()), msg
        assert torch.equal(got.qblock_seq.cpu(), want.qblock_seq.cpu()), msg
        assert torch.equal(got.qblock_start.cpu(), want.qblock_start.cpu()), msg
        assert got.block_size == want.block_size == block
        if step:  # the whole prompts: the budget leaves some causal blocks out, so the scores decided something
            counts = (want.indices >= 0).sum(-1).cpu()
            assert (counts < view.qblocks(block).qblock.cpu() + 1).any(), msg


@pytest.mark.parametrize("qpage,cpage,dtype", [(4, 16, torch.float32), (16, 16, torch.bfloat16),
                                               (8, 32, torch.bfloat16)])
def test_bound_update_kernel_matches_the_pytorch_form(qpage, cpage, dtype, monkeypatch):
    """``Quest.update_state`` through ``update_page_bounds`` (one launch) against its PyTorch form, on two caches
    fed the same keys: a prefill in two chunks on shuffled pages, then decode steps across Quest and cache page
    bounds, the pools equal bit for bit after every step (stale bounds in them first, as a reused page holds)."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    d = 16
    cfg = ModelConfig(97, H_KV * G * d, 80, 3, H_KV * G, H_KV, d, 1e-5, 4096, False)
    quest = Quest(cfg, QuestConfig(density=0.3, block_size=max(16, cpage), page_size=qpage))
    lens = [int(x) for x in torch.randint(2, 70, (3,), generator=g)]
    steps = 2 * qpage + 3
    n_pages = sum(-(-(n + steps) // cpage) for n in lens) + 2
    perm = torch.randperm(n_pages, generator=g).tolist()
    caches = []
    for _ in range(2):
        cache = KVCache(cfg, num_pages=n_pages, page_size=cpage, dtype=dtype, device=DEV, num_kv_heads=H_KV)
        for pool, stale in zip(quest._pools(LAYER, cache), (-40.0, 40.0), strict=True):
            pool.fill_(stale)
        used = 0
        for sid, n in enumerate(lens):
            m = -(-(n + steps) // cpage)
            cache.attach(sid, perm[used: used + m], n + steps)
            used += m
        caches.append(cache)
    first = [int(torch.randint(1, n + 1, (), generator=g)) for n in lens]
    chunks = [(first, True), ([n - f for n, f in zip(lens, first, strict=True)], True)]
    chunks += [([1, 1, 1], False)] * steps
    for i, (chunk, prefill) in enumerate(chunks):
        k = (torch.randn(sum(chunk), H_KV, d, generator=g) * 1.5 - 0.2).to(dtype).to(DEV)
        for cache, mode in zip(caches, ("triton", "torch"), strict=True):
            batch = cache.prepare([0, 1, 2], chunk, prefill)
            cache.write(LAYER, k, torch.zeros_like(k), batch)
            monkeypatch.setenv("RAYSPARSE_KERNELS", mode)
            quest.update_state(LAYER, cache, batch)
        for got, want in zip(quest._pools(LAYER, caches[0]), quest._pools(LAYER, caches[1]), strict=True):
            assert torch.equal(got, want), f"seed {seed}, step {i}"
