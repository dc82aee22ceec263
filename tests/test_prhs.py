"""PrHS (CIS, PSAW, ETF, CPE) against independent brute force on fresh random inputs."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import fresh_cache, random_state, tiny_hf_config, whole_model_density
from test_cis_pages import brute_pages_top

from raysparse.attention import DenseAttention
from raysparse.config import ModelConfig
from raysparse.generate import GenerationRequest, Generator
from raysparse.kernels.dispatch import paged_window_decode
from raysparse.kernels.formats import PagedKV
from raysparse.loader import model_from_state
from raysparse.methods.budget import host_row_budget
from raysparse.methods.cis import cis_budget, page_budget
from raysparse.methods.prhs import CIS, CPE, ETF, PSAW, CPEConfig, PSAWConfig
from raysparse.methods.psaw import window_lists, window_lo, window_prefill
from raysparse.methods.psaw_window import paged_window_prefill_cpu
from raysparse.methods.registry import create_backend
from raysparse.methods.selection import SENTINEL, TokenSelection
from raysparse.methods.sparse_attention import sparse_decode_attention
from raysparse.methods.views import SeqContext
from raysparse.sampling import SamplingParams

H_KV, G, D, N_LAYERS = 2, 3, 16, 8


def model_cfg() -> ModelConfig:
    return ModelConfig(97, H_KV * G * D, 80, N_LAYERS, H_KV * G, H_KV, D, 1e-5, 4096, False)


def gen(seed: int | None = None) -> torch.Generator:
    return torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())) if seed is None else seed)


def boundary(base: float, expo: float, layer: int, l_s: int, t: int) -> int:
    """the paper's P_l(t) / E_l(t), written out independently."""
    if layer < l_s:
        return 0
    return math.floor((1 - base ** (expo * (layer - l_s) / (N_LAYERS - l_s))) * t)


def psaw_visible(p: int, layer: int, sink: int, l_s: int = 6, phi: float = 0.7, alpha: float = 1.0) -> list[int]:
    """0-based keys the query at 0-based position p sees: 1-based {1..C_sink} U [P_l(t), t], t = p + 1."""
    t = p + 1
    lo = boundary(phi, alpha, layer, l_s, t)
    return [j for j in range(p + 1) if j + 1 <= sink or lo <= j + 1 <= t]


def rows_of(indices: torch.Tensor) -> list[list[int]]:
    return [[int(x) for x in row if x != SENTINEL] for row in indices.reshape(-1, indices.shape[-1])]


def assert_set_rows(indices: torch.Tensor, n: int) -> None:
    """Ascending, deduplicated, causal, sentinels only at the end."""
    for row in indices.reshape(-1, indices.shape[-1]).tolist():
        valid = [x for x in row if x != SENTINEL]
        assert row[: len(valid)] == valid and valid == sorted(set(valid)) and 0 <= valid[0] and valid[-1] < n


# ---- PSAW --------------------------------------------------------------------------------------
@pytest.mark.parametrize("layer,n,n_q,sink", [(7, 90, 90, 3), (7, 70, 23, 5), (6, 40, 40, 2), (5, 33, 33, 4)])
def test_psaw_prefill_and_decode_follow_the_formula(layer, n, n_q, sink):
    g = gen()
    q = torch.randn(n_q, H_KV * G, D, generator=g)
    k, v = torch.randn(H_KV, n, D, generator=g), torch.randn(H_KV, n, D, generator=g)
    m = PSAW(model_cfg(), PSAWConfig(sink=sink, block_size=8))
    assert m.start_layer == 6
    ctx = SeqContext(layer, 0, n - n_q, n, {})
    out, pairs = m.prefill_seq(ctx, q, k, v)
    want_pairs = 0
    for r in range(n_q):
        p = n - n_q + r
        vis = psaw_visible(p, layer, sink)
        want_pairs += len(vis) * H_KV
        for h in range(H_KV * G):
            kh, vh = k[h // G, vis], v[h // G, vis]
            ref = torch.softmax(kh @ q[r, h] / math.sqrt(D), 0) @ vh
            assert torch.allclose(out[r, h], ref, atol=1e-5)
    assert pairs == want_pairs
    sel = m.select_prefill(ctx, q, k, v)  # block view: exactly the blocks holding a visible key of some row
    for qb, row in enumerate(rows_of(sel.indices[0])):
        ps = [p for p in range(n - n_q, n) if p // 8 == (n - n_q) // 8 + qb]
        assert row == sorted({j // 8 for p in ps for j in psaw_visible(p, layer, sink)})
    dec = m.select_decode(SeqContext(layer, 0, n - 1, n, {}), q[-1], k, v)
    assert_set_rows(dec.indices, n)
    assert all(r == psaw_visible(n - 1, layer, sink) for r in rows_of(dec.indices))
    lens = torch.arange(1, n + 1)  # the batched decode's fixed-width lists, rows of every length up to n
    assert rows_of(window_lists(m.psaw_frac(layer), sink, lens, n)) == [psaw_visible(i - 1, layer, sink) for i in lens]
    assert [m.decode_keys(layer, i) for i in range(1, n + 1)] == [len(psaw_visible(i - 1, layer, sink)) for i in lens]


def test_psaw_cpu_prefill_equals_the_masked_reference():
    """The CPU's batched windowed prefill (``paged_window_prefill_cpu``: a ragged batch's K/V read from scattered
    pages in one copy, each sequence's rows through ``window_attention_cpu``: unmasked middle, causal own block,
    masked sinks and band, merged) against ``window_prefill``'s masked attention over each sequence's gathered K/V,
    element by element: chunks of few rows, windows starting inside the rows' own block (fractions near 1), no
    sinks, sinks past the prompt, chunked prompts, sequences of one key, pages of several sizes."""
    seed = int(torch.randint(0, 1 << 30, ()))
    g = gen(seed)
    for case in range(60):
        page, b = [4, 8, 16][case % 3], int(torch.randint(1, 5, (), generator=g))
        lens = torch.randint(1, 600, (b,), generator=g)
        lens[0] = 1 if case % 7 == 0 else lens[0]
        q_lens = [n if (case + i) % 3 == 0 else int(torch.randint(1, n + 1, (), generator=g))
                  for i, n in enumerate(lens.tolist())]
        sink = [0, 1, 16, 700][case % 4] if case % 2 else int(torch.randint(0, 40, (), generator=g))
        frac = [0.0, 1.0, 0.999][case % 3] if case % 5 == 0 else float(torch.rand((), generator=g)) ** 2
        rows = int(torch.randint(1, 200, (), generator=g))
        rows = rows if case % 4 else 8 * (rows % 8 + 1)  # or a multiple of the pages' sizes
        width = -(-int(lens.max()) // page)
        pages = b * width + 2  # all distinct, in random order
        table = torch.randperm(pages, generator=g)[: b * width].view(b, width).to(torch.int32)
        k, v = torch.randn(pages, H_KV, page, D, generator=g), torch.randn(pages, H_KV, page, D, generator=g)
        q = torch.randn(sum(q_lens), H_KV * G, D, generator=g)
        got = paged_window_prefill_cpu(q, PagedKV(k, v, table, lens.to(torch.int32)), q_lens, sink, frac,
                                       rows_per_call=rows)
        assert got.shape == q.shape
        row = 0
        for i, (n, n_q) in enumerate(zip(lens.tolist(), q_lens, strict=True)):
            kk = k[table[i].long()].transpose(0, 1).reshape(H_KV, -1, D)[:, :n]
            vv = v[table[i].long()].transpose(0, 1).reshape(H_KV, -1, D)[:, :n]
            want, _ = window_prefill(q[row: row + n_q], kk, vv, n - n_q, sink, frac, [(0, n_q)])
            msg = lambda m, c=case, i=i: f"seed {seed} case {c} sequence {i}: {m}"  # noqa: E731
            torch.testing.assert_close(got[row: row + n_q], want, rtol=1e-5, atol=1e-5, msg=msg)
            row += n_q


def test_psaw_cpu_batched_prefill_reads_the_pages_and_meters_as_the_reference(monkeypatch):
    """PSAW's batched prefill on a CPU (a ragged step, some prompts in their second chunk) against the per-sequence
    reference path (a tracer sends every layer there): the same outputs and metered keys, and no sequence's K/V
    gathered whole (``KVCache.gather``, the per-sequence path's)."""
    from raysparse.kv_cache import KVCache

    seed = int(torch.randint(0, 1 << 30, ()))
    g = gen(seed)
    lens = [int(x) for x in torch.randint(1, 300, (4,), generator=g)]
    done = [0 if i % 2 else int(torch.randint(0, n, (), generator=g)) for i, n in enumerate(lens)]
    cache = KVCache(model_cfg(), 200, 8)
    for i, (n, d) in enumerate(zip(lens, done, strict=True)):
        cache.allocate(i, n)
        if d:
            cache.prepare([i], [d], True)  # an earlier chunk: this step starts mid-prompt
    batch = cache.prepare(list(range(4)), [n - d for n, d in zip(lens, done, strict=True)], True)
    params = dict(sink=int(torch.randint(0, 20, (), generator=g)), start_layer=4, phi=0.3, block_size=8)
    got_m, want_m = PSAW(model_cfg(), PSAWConfig(**params)), PSAW(model_cfg(), PSAWConfig(**params))
    want_m.tracer = lambda *a: None
    for layer in range(5, N_LAYERS):  # every layer where PSAW prunes
        cache.k[layer].normal_(generator=g)
        cache.v[layer].normal_(generator=g)
        q = torch.randn(batch.positions.numel(), H_KV * G, D, generator=g)
        want = want_m.prefill(layer, q, cache, batch)
        with monkeypatch.context() as mp:
            mp.setattr(KVCache, "gather", lambda *a: pytest.fail("the batched prefill gathered a sequence"))
            got = got_m.prefill(layer, q, cache, batch)
        msg = lambda m, la=layer: f"seed {seed} layer {la}: {m}"  # noqa: E731
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=msg)
    assert got_m.meter.attended == pytest.approx(want_m.meter.attended), f"seed {seed}"
    assert got_m.meter.causal == pytest.approx(want_m.meter.causal), f"seed {seed}"
    assert got_m.meter.overall() < 1.0, f"seed {seed}"


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_psaw_window_decode_equals_the_gathering_reference(kernels, monkeypatch):
    """``paged_window_decode`` (the window's pages attended whole, the rest of them masked: the fused CPU call, or
    the split-K kernel with its window bound, on a GPU where there is one, else under the interpreter) against
    attention over the exact token list
    gathered from each row's K/V, on ragged batches over scattered pages: sinks over several pages, windows
    starting inside the sinks' pages, rows of one key. The kernel's page list has the fixed width a captured step
    gives it, from a bound on the windows."""
    monkeypatch.setenv("RAYSPARSE_KERNELS", kernels)
    dev = "cuda" if kernels == "triton" and torch.cuda.is_available() else "cpu"  # compiled kernels: device tensors
    tol = 1e-5 if dev == "cpu" else 5e-3  # TF32 dots on a GPU
    seed = int(torch.randint(0, 1 << 30, ()))
    g = gen(seed)
    page, pages = 8, 80  # 5 rows of up to 15 pages, all distinct
    for case in range(30 if kernels == "torch" else 6):
        b = int(torch.randint(1, 6, (), generator=g))
        lens = torch.randint(1, 120, (b,), generator=g)
        lens[0] = 1 if case % 4 == 0 else lens[0]
        sink = int(torch.randint(0, 30, (), generator=g))
        frac = float(torch.rand((), generator=g))
        width = -(-int(lens.max()) // page)
        table = torch.randperm(pages, generator=g)[: b * width].view(b, width).to(torch.int32)
        k = torch.randn(pages, H_KV, page, D, generator=g)
        v = torch.randn(pages, H_KV, page, D, generator=g)
        q = torch.randn(b, H_KV * G, D, generator=g)
        lo = window_lo(frac, lens - 1)
        widest = int((lens - lo).max()) + (case % 2) * int(torch.randint(0, 20, (), generator=g))  # tight or not
        kv = PagedKV(k.to(dev), v.to(dev), table.to(dev), lens.to(torch.int32).to(dev))
        out, lse = (t.cpu() for t in paged_window_decode(q.to(dev), kv, lo.to(dev), sink, widest))
        for i in range(b):
            n = int(lens[i])
            kk = k[table[i].long()].transpose(0, 1).reshape(H_KV, -1, D)[:, :n]
            vv = v[table[i].long()].transpose(0, 1).reshape(H_KV, -1, D)[:, :n]
            keys = torch.tensor([j for j in range(n) if j < sink or j >= int(lo[i])], dtype=torch.int32)
            o, s = sparse_decode_attention(q[i], kk, vv, TokenSelection(keys[None].expand(H_KV, -1), 1))
            msg = lambda m, c=case, i=i: f"seed {seed} case {c} row {i}: {m}"  # noqa: E731
            torch.testing.assert_close(out[i], o, rtol=tol, atol=tol, msg=msg)
            torch.testing.assert_close(lse[i], s, rtol=tol, atol=tol, msg=msg)


# ---- CIS ---------------------------------------------------------------------------------------
def brute_cis(qs, ks, sink, local, budget_of, r, s, thr, lo_of, rank=None):
    """Per-head loop simulation of CIS; returns the per-step per-head sets and the retrieval count.
    ``budget_of(n)`` gives (k, m, limit) at a step with n keys; ``rank(q, k, n, lo, kk)`` (None: the oracle
    below) gives each KV head's ranked top-kk."""
    anchors: list[list] = [[] for _ in range(H_KV)]
    sets, retrievals = [], 0
    for step, (q, kk) in enumerate(zip(qs, ks, strict=True)):
        n = kk.shape[1]
        if step % s == 0:
            anchors = [[] for _ in range(H_KV)]
        lo = lo_of(n)
        vis = [j for j in range(n) if j < sink or j >= lo]
        step_sets = []
        for h in range(H_KV):
            qv = q[h * G:(h + 1) * G].flatten().double()
            share = None
            for aq, aset in reversed(anchors[h]):
                if float(qv @ aq / (qv.norm() * aq.norm())) > thr:
                    share = aset
                    break
            fixed = {j for j in range(n) if j < sink or j >= n - local}
            k, m, limit = budget_of(n)
            if share is None:
                retrievals += 1
                probs = sum(torch.softmax(kk[h].double() @ q[h * G + i].double() / math.sqrt(D), 0) for i in range(G))
                cands = [j for j in vis if j not in fixed]
                ranked = (sorted(cands, key=lambda j: (-float(probs[j]), j))[:k] if rank is None
                          else rank(q, kk, n, lo, k)[h])
                # priority order: each of the top-m, then its neighbours; then the rest of the ranking
                prio = [x for p in ranked[:m] for x in [p] + [p + o for o in range(-r, r + 1) if o]] + ranked[m:]
                distinct = list(dict.fromkeys(x for x in prio if 0 <= x < n))
                anchors[h].append((qv, set(distinct if limit is None else distinct[:limit])))
                middle = set(ranked)
            else:
                middle = {j for j in share if j < n}
            step_sets.append(sorted((fixed | middle) & set(vis)))
        sets.append(step_sets)
    return sets, retrievals


@pytest.mark.parametrize("kind", ["cis", "cpe", "cis-density", "cis-pages", "cpe-pages"])
def test_cis_sets_and_retrieval_ratio_match_loop_simulation(kind):
    g = gen()
    sink, local, topk, s, r, thr, steps, n0 = 2, 3, 7, 4, 1, 0.75, 14, 30
    kw = dict(sink=sink, local=local, topk=topk, share_block=s, radius=r, threshold=thr)
    rank = None
    if kind.endswith("-pages"):  # the top 3 pages of 4 by Quest's bound (of 8 to 11), then their exact top-k
        kw.update(retrieval="pages", retrieval_page=4, page_factor=1.5)
        rank = lambda q, kk, n, lo, k: brute_pages_top(  # noqa: E731
            q, kk, max(sink, lo), n - local, {j for j in range(n) if j < sink or (j >= n - local and j >= lo)}, k,
            page_budget(m.config, k), 4)
    if kind.startswith("cis"):
        # with a density, an anchor's set (the top-m's neighbours included) is limited to the middle budget
        cfg = CIS.config_cls(**kw, **({"density": 0.55} if kind == "cis-density" else {}))
        m, layer = CIS(model_cfg(), cfg), 3
        lo_of = lambda n: 0  # noqa: E731
    else:
        m, layer = CPE(model_cfg(), CPEConfig(**kw)), 7
        lo_of = lambda n: max(boundary(0.7, 1.0, 7, 6, n) - 1, 0)  # noqa: E731
    k_all = torch.randn(H_KV, n0 + steps, D, generator=g) * 1.5
    base = torch.randn(H_KV * G, D, generator=g)
    qs, ks, state = [], [], {}
    for step in range(steps):
        if step % 5 == 3:
            base = torch.randn(H_KV * G, D, generator=g)  # a jump: similarity drops
        qs.append(base + 0.55 * torch.randn(H_KV * G, D, generator=g))
        ks.append(k_all[:, : n0 + step + 1])
    got = []
    for q, kk in zip(qs, ks, strict=True):
        n = kk.shape[1]
        sel = m.select_decode(SeqContext(layer, 0, n - 1, n, state), q, kk, kk)
        assert_set_rows(sel.indices, n)
        rows = rows_of(sel.indices)
        assert all(set(range(sink)) <= set(row) and set(range(n - local, n)) <= set(row) for row in rows)
        if m.config.density is not None:  # every step, sharing ones included, within the budget
            assert all(len(row) <= host_row_budget(m.config.density, n) for row in rows)
        got.append(rows)
    want, retrievals = brute_cis(qs, ks, sink, local, lambda n: cis_budget(m.config, n), r, s, thr, lo_of, rank)
    assert got == want
    assert m.retrieval_ratio == pytest.approx(retrievals / (steps * H_KV))
    assert 0 < m.retrieval_ratio < 1  # both sharing and re-retrieval happened
    per_layer = m.retrieval_ratio_per_layer()
    assert per_layer[layer] == pytest.approx(m.retrieval_ratio) and per_layer[0] is None


def test_cis_density_sets_the_middle_budget():
    m = create_backend("cis", model_cfg(), density=whole_model_density(0.25, N_LAYERS))  # 0.25 per sparse layer
    # with a density: k = the middle budget, m = k // (3 + 2 r), the set limited to k
    assert cis_budget(m.config, 1000) == (250 - 16 - 64, (250 - 16 - 64) // 5, 250 - 16 - 64)
    assert cis_budget(m.config, 100) == (0, 0, 0)
    assert cis_budget(create_backend("cis", model_cfg()).config, 5000) == (432, 144, None)  # the paper's: no limit
    with pytest.raises(ValueError):
        create_backend("cis", model_cfg(), phi=0.5)


# ---- on the tiny model -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    cfg = tiny_hf_config(layers=N_LAYERS)
    return model_from_state(cfg, random_state(cfg, seed=3).state_dict())


def run_steps(model, backend, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Packed ragged prefill of the prompts, then greedy decode steps; the logits of every step."""
    cache = fresh_cache(model, 1024)
    ids = list(range(len(prompts)))
    for i, p in enumerate(prompts):
        cache.allocate(i, len(p) + steps)
    logits = [model(torch.tensor([t for p in prompts for t in p]), cache.prepare(ids, [len(p) for p in prompts], True),
                    cache, backend)]
    for _ in range(steps):
        nxt = logits[-1].argmax(-1)
        logits.append(model(nxt, cache.prepare(ids, [1] * len(ids), False), cache, backend))
    return logits


@pytest.fixture(scope="module")
def dense_run(model):
    prompts = [torch.randint(0, 97, (n,)).tolist() for n in (45, 30)]
    return prompts, run_steps(model, DenseAttention(N_LAYERS), prompts, 4)


@pytest.mark.parametrize("name,params", [
    ("cis", dict(threshold=2.0, topk=10**6, sink=2, local=3)),  # always retrieves, k >= n
    ("psaw", dict(sink=10**6)),  # PSAW's masked path runs at layer 7, with every key a sink
    ("psaw", dict(phi=1.0)),
    ("etf", dict(psi=1.0)),
    ("cpe", dict(threshold=2.0, topk=10**6, sink=2, local=3, phi=1.0, psi=1.0)),
    ("cpe", dict(threshold=2.0, topk=10**6, sink=10**6)),
])
def test_dense_parameters_reproduce_dense(model, dense_run, name, params):
    prompts, ref = dense_run
    got = run_steps(model, create_backend(name, model.cfg, **params), prompts, 4)
    for a, b in zip(ref, got, strict=True):
        assert (a - b).abs().max().item() < 1e-5


def test_etf_freezes_exactly_the_formula_rows(model):
    sink, l_s = 3, 4
    lens = [80, 41]
    backend = ETF(model.cfg, ETF.config_cls(sink=sink, start_layer=l_s))
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [layer.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, (args[0].clone(), out)))
             for i, layer in enumerate(model.model.layers)]
    model.set_fused_ops("torch")  # the plain layer loop calls each layer's module, so the hooks see its in and out
    try:
        cache = fresh_cache(model, 512)
        for i, n in enumerate(lens):
            cache.allocate(i, n)
        ids = torch.randint(0, 97, (sum(lens),))
        model(ids, cache.prepare([0, 1], lens, True), cache, backend)
    finally:
        model.set_fused_ops("auto")
        for hk in hooks:
            hk.remove()
    frozen_any = 0
    for layer in range(N_LAYERS):
        h_in, h_out = seen[layer]
        rows, attended, off = [], 0, 0
        for n in lens:  # 1-based positions in (C_sink, E_l(t)) with t = the prompt length
            e = boundary(0.5, 1.0, layer, l_s, n)
            rows += [off + p - 1 for p in range(1, n + 1) if sink < p < e]
            attended += sum(p for p in range(1, n + 1) if not sink < p < e) * model.cfg.num_kv_heads
            off += n
        live = sorted(set(range(sum(lens))) - set(rows))
        assert torch.equal(h_out[rows], h_in[rows])  # carried unchanged: attention and MLP skipped
        assert all((h_out[r] != h_in[r]).any() for r in live)
        assert backend.meter.attended[layer] == attended
        frozen_any += len(rows) > 0
    assert frozen_any == N_LAYERS - l_s - 1  # every layer past l_s froze something


def test_etf_copy_mode_reuses_previous_layer_kv(model):
    sink, n = 2, 60
    ids = torch.randint(0, 97, (n,))
    keys = {}
    for mode in ("project", "copy"):
        cache = fresh_cache(model, 128)
        cache.allocate(0, n)
        batch = cache.prepare([0], [n], True)
        model(ids, batch, cache, create_backend("etf", model.cfg, sink=sink, etf_kv=mode))
        keys[mode] = [cache.gather(layer, batch, 0)[0] for layer in range(N_LAYERS)]
    fr = list(range(sink, boundary(0.5, 1.0, 7, 6, n) - 1))  # frozen at layer 7 only (l_s = 6)
    cp, pr = keys["copy"], keys["project"]
    assert fr and torch.equal(cp[7][:, fr], cp[6][:, fr])
    assert not torch.equal(pr[7][:, fr], pr[6][:, fr])
    assert all(torch.equal(cp[i], pr[i]) for i in range(7))
    assert torch.equal(cp[7][:, fr[-1] + 1:], pr[7][:, fr[-1] + 1:])


def test_methods_generate_and_report(model):
    prompt = tuple(torch.randint(0, 97, (50,)).tolist())
    for name in ("cis", "psaw", "etf", "cpe"):
        backend = create_backend(name, model.cfg, sink=4, **({"local": 8, "topk": 12, "share_block": 4}
                                                              if name in ("cis", "cpe") else {}))
        gen_ = Generator(model, fresh_cache(model, 256), backend)
        ev = list(gen_.generate([GenerationRequest(prompt, SamplingParams(6, ignore_eos=True), name)]))
        assert len(ev[-1].token_ids) == 6 and gen_.cache.free_pages == gen_.cache.num_pages
        assert backend.meter.overall() < 1.0
        if name in ("cis", "cpe"):
            assert 0 < backend.retrieval_ratio <= 1


# ---- the batched decode seam: CIS state across changing batches -------------------------------------
@pytest.mark.parametrize("name,params", [
    ("cis", dict(density=whole_model_density(0.15, 3, 1), sink=4, local=8, share_block=4, threshold=0.1)),
    ("cpe", dict(start_layer=1, phi=0.3, topk=12, sink=2, local=3, share_block=3, radius=2, threshold=0.1)),
    # the page retrieval: the bounds kept per cache page through prefill and decode, the top pages' keys scored
    ("cis", dict(density=whole_model_density(0.15, 3, 1), sink=4, local=8, share_block=4, threshold=0.1,
                 retrieval="pages", retrieval_page=8, page_factor=1.5)),
    ("cpe", dict(start_layer=1, phi=0.3, topk=12, sink=2, local=3, share_block=3, radius=2, threshold=0.1,
                 retrieval="pages", retrieval_page=16)),
])
def test_cis_batched_state_follows_sequences_across_batches(name, params):
    """Sequences join, leave, come back in other rows, padded rows fill buckets, a released id is prefilled
    anew: the batched path (graph runner's padded steps and plain batched steps) keeps each sequence's anchors
    and gives the per-sequence reference path's logits, density and retrieval counts."""
    from helpers import tiny_model

    from raysparse.decode_graphs import DecodeGraphs
    from raysparse.kv_cache import KVCache

    seed = int(torch.randint(0, 1 << 30, ()))
    model = tiny_model("cpu", 2, 2, 3)
    g = gen(seed)
    prompts = {sid: torch.randint(0, 97, (n,), generator=g).tolist() for sid, n in enumerate((70, 130, 45))}
    later = {2: torch.randint(0, 97, (60,), generator=g).tolist(), 3: torch.randint(0, 97, (90,), generator=g).tolist()}
    # (action, sequences, steps); "graph": the graph runner's padded step, "plain": the model's batched decode
    plan = [("graph", [0, 1, 2], 3), ("plain", [2, 0], 2), ("graph", [1, 2, 0], 2), ("renew", [2, 3], 0),
            ("graph", [3, 2, 1], 5), ("plain", [0], 2), ("graph", [1, 3], 2)]
    ids = torch.randint(0, 97, (sum(len(s) * k for _, s, k in plan),), generator=g).tolist()
    runs = []
    for batched in (False, True):
        backend = create_backend(name, model.cfg, dense_layers=(0,), **params)
        if not batched:
            backend.tracer = lambda *a: None  # the per-sequence reference path
        cache = KVCache(model.cfg, 48, 32)
        graphs = DecodeGraphs(model, cache, max_batch=4)

        def prefill(sid: int, prompt: list[int], cache=cache, backend=backend) -> None:
            cache.allocate(sid, len(prompt) + 20)
            model(torch.tensor(prompt), cache.prepare([sid], [len(prompt)], True), cache, backend)

        for sid, p in prompts.items():
            prefill(sid, p)
        backend.meter.reset()
        backend.reset_stats()
        logits, it = [], iter(ids)
        for action, sids, steps in plan:
            if action == "renew":
                cache.free(2)
                backend.release(2)
                for sid in sids:
                    prefill(sid, later[sid])
                continue
            for _ in range(steps):
                tok = [next(it) for _ in sids]
                if batched and action == "graph":
                    logits.append(graphs.decode("k", backend, sids, tok).clone())
                else:
                    logits.append(model(torch.tensor(tok), cache.prepare(sids, [1] * len(sids), False), cache, backend))
        runs.append((torch.cat(logits), backend.meter.decode_attended, backend.meter.decode_causal,
                     backend.retrieval_ratio_per_layer()))
    (ref, att0, cau0, rho0), (got, att1, cau1, rho1) = runs
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4, msg=lambda m: f"seed {seed}: {m}")
    assert (att1, cau1) == pytest.approx((att0, cau0)), f"seed {seed}"
    assert rho1 == pytest.approx(rho0), f"seed {seed}"
    assert all(0 < r < 1 for r in rho1[1:]), f"seed {seed}: both sharing and retrieval"



@pytest.mark.parametrize("same", [True, False])
def test_cis_rows_take_equals_row_by_row_copies(same, monkeypatch):
    """``CISRows.take`` (runs of rows as slices, within one buffer or from another, in pieces) against copying
    each row from a snapshot of the source, every element of every buffer: a scattered mapping and a shift."""
    from raysparse.methods import cis_batched
    from raysparse.methods.cis import CISConfig

    seed = int(torch.randint(0, 1 << 30, ()))
    g = gen(seed)
    cfg = CISConfig(density=0.1, share_block=2)
    rows, names = 12, ("q", "sets", "valid", "step")

    def rows_buf() -> cis_batched.CISRows:
        b = cis_batched.CISRows(3, rows, cfg, 2, 4, 5, torch.device("cpu"))
        b.q.copy_(torch.randn(b.q.shape, generator=g))
        b.sets.copy_(torch.randint(-1, 50, b.sets.shape, generator=g, dtype=torch.int32))
        b.valid.copy_(torch.rand(b.valid.shape, generator=g) < 0.5)
        b.step.copy_(torch.randint(0, 9, b.step.shape, generator=g))
        return b

    first, second = rows_buf(), rows_buf()
    mappings = [(torch.randperm(rows, generator=g)[:9].tolist(), torch.randperm(rows, generator=g)[:9].tolist()),
                (list(range(4, rows)), list(range(3, rows - 1)))]  # a sequence at row 3 finished: the rest shift
    for src, dst in mappings:
        for piece in (1, 1 << 30):  # a row a piece, and every run whole
            monkeypatch.setattr(cis_batched, "TAKE_BYTES", piece)
            mine = cis_batched.CISRows(3, rows, cfg, 2, 4, 5, torch.device("cpu"))
            for n in names:
                getattr(mine, n).copy_(getattr(first, n))
            other = mine if same else second
            want = {n: getattr(mine, n).clone() for n in names}
            for a, b in zip(src, dst, strict=True):
                for n in names:
                    want[n][:, b] = getattr(first if same else second, n)[:, a]
            mine.take(other, src, dst)
            for n in names:
                assert torch.equal(getattr(mine, n), want[n]), f"seed {seed}: {n}, {src} -> {dst}, piece {piece}"
