"""Streaming, Quest and oracle top-k against independent brute force on fresh random inputs."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import prefill_block_budgets

from raysparse.attention import causal_pairs, dense_attention
from raysparse.config import ModelConfig
from raysparse.kv_cache import KVCache
from raysparse.methods.baselines import (
    Oracle,
    OracleConfig,
    Streaming,
    StreamingConfig,
    page_bounds,
    page_upper_bound,
)
from raysparse.methods.budget import host_row_budget, row_budget
from raysparse.methods.quest import Quest, QuestConfig
from raysparse.methods.registry import create_backend
from raysparse.methods.selection import SENTINEL
from raysparse.methods.views import SeqContext

H_KV, G, D = 2, 3, 16


def model_cfg(layers: int = 3) -> ModelConfig:
    return ModelConfig(97, H_KV * G * D, 80, layers, H_KV * G, H_KV, D, 1e-5, 4096, False)


def rand_qkv(n: int, n_q: int | None = None, seed: int | None = None):
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 1 << 30, ()).item()))
    n_q = n if n_q is None else n_q
    k = torch.randn(H_KV, n, D, generator=g) * 1.5
    v = torch.randn(H_KV, n, D, generator=g)
    q = torch.randn(n_q, H_KV * G, D, generator=g) * 1.5 + 0.3
    return q, k, v


def ctx_for(n: int, n_q: int, state: dict | None = None) -> SeqContext:
    return SeqContext(2, 0, n - n_q, n, {} if state is None else state)


def budget(density: float, units: int) -> int:
    return max(1, round(density * units))


def rows_of(indices: torch.Tensor) -> list[list[int]]:
    return [[int(x) for x in row if x != SENTINEL] for row in indices.reshape(-1, indices.shape[-1])]


def assert_well_formed(indices: torch.Tensor, limits: list[int]) -> None:
    """Every row ascending, no repeats, sentinels only at the end, entries in [0, limit]."""
    flat = indices.reshape(-1, indices.shape[-1])
    for r, row in enumerate(flat.tolist()):
        valid = [x for x in row if x != SENTINEL]
        assert row[: len(valid)] == valid and all(x == SENTINEL for x in row[len(valid):])
        assert valid == sorted(set(valid)) and valid and valid[0] >= 0
        assert valid[-1] <= limits[r % len(limits)]


def methods(density: float | None, b: int = 16):
    sc = StreamingConfig(density=density, block_size=b, sink_tokens=16, window=64)
    d = 0.3 if density is None else density
    return [Streaming(model_cfg(), sc), Quest(model_cfg(), QuestConfig(density=d, block_size=b)),
            Oracle(model_cfg(), OracleConfig(density=d, block_size=b))]


# ---- Quest -------------------------------------------------------------------------------------
def test_quest_upper_bound_never_below_true_page_max():
    for trial in range(40):
        n, page = int(torch.randint(1, 200, ())), [4, 16][trial % 2]
        q, k, _ = rand_qkv(n, 5)
        k = k * torch.rand(1, 1, D) * 4 - float(trial % 3)  # skewed, shifted keys
        lo, hi = page_bounds(k, page)
        qh = q.view(5, H_KV, G, D).permute(1, 2, 0, 3)  # [h_kv, g, m, d]
        for j in range(G):
            ub = page_upper_bound(qh[:, j: j + 1], lo, hi)  # one query head: [h_kv, m, pages]
            dots = torch.einsum("hmd,hnd->hmn", qh[:, j], k)
            pad = lo.shape[1] * page - n
            true = torch.nn.functional.pad(dots, (0, pad), value=-math.inf).view(H_KV, 5, -1, page).amax(-1)
            assert (ub >= true - 1e-4).all()


def brute_quest_page_scores(q: torch.Tensor, k: torch.Tensor, page: int) -> torch.Tensor:
    """[h_kv, pages] bound per KV head, loops over pages and heads, max over the group."""
    n = k.shape[1]
    pages = -(-n // page)
    out = torch.empty(H_KV, pages)
    for h in range(H_KV):
        for p in range(pages):
            keys = k[h, p * page: min(n, (p + 1) * page)]
            mn, mx = keys.min(0).values, keys.max(0).values
            out[h, p] = max(float(torch.maximum(q[i] * mn, q[i] * mx).sum()) for i in range(h * G, h * G + G))
    return out


def brute_topk(scores: list[float], candidates: list[int], k: int) -> set[int]:
    return set(sorted(candidates, key=lambda j: (-scores[j], j))[: max(k, 0)])


def test_quest_decode_selection_matches_brute_force_as_keys_are_appended():
    density, n0 = 0.3, 150
    q, k, v = rand_qkv(n0 + 40, 40)
    m = Quest(model_cfg(), QuestConfig(density=density, block_size=16))
    state: dict = {}
    m.select_prefill(ctx_for(n0, n0, state), rand_qkv(n0)[0], k[:, :n0], v[:, :n0])
    for n in range(n0, n0 + 40, 3):  # skip steps: the state must catch up with several new keys
        sel = m.select_decode(ctx_for(n, 1, state), q[n - n0], k[:, :n], v[:, :n])
        assert sel.block_size == 16
        scores = brute_quest_page_scores(q[n - n0], k[:, :n], 16)
        pages = scores.shape[1]
        lo, hi = page_bounds(k[:, :n], 16)
        assert torch.equal(state["quest_min"][:, :pages], lo) and torch.equal(state["quest_max"][:, :pages], hi)
        forced = {0, pages - 1}
        for h, row in enumerate(rows_of(sel.indices)):
            top = brute_topk(scores[h].tolist(), [j for j in range(pages) if j not in forced],
                             budget(density, pages) - len(forced))
            assert set(row) == top | forced and row == sorted(row)


def test_quest_prefill_selection_matches_brute_force():
    density, b, n, n_q = 0.35, 32, 230, 180
    q, k, v = rand_qkv(n, n_q)
    sel = Quest(model_cfg(), QuestConfig(density=density, block_size=b)).select_prefill(ctx_for(n, n_q), q, k, v)
    qs = n - n_q
    nkb = -(-n // b)
    pscores_per_block = []
    for qb in range(qs // b, (n - 1) // b + 1):
        rows = [i - qs for i in range(qb * b, min(n, qb * b + b)) if i >= qs]
        qmean = q[rows].mean(0)
        ps = brute_quest_page_scores(qmean, k, 16)
        pscores_per_block.append((qb, torch.stack([ps[:, 2 * j: 2 * j + 2].max(1).values for j in range(nkb)], 1)))
    for r, (qb, scores) in enumerate(pscores_per_block):
        forced = {0, qb}
        for h in range(H_KV):
            got = rows_of(sel.indices[h, r: r + 1])[0]
            top = brute_topk(scores[h].tolist(), [j for j in range(qb + 1) if j not in forced],
                             prefill_block_budgets(density, qb + 1, 2, b)[qb] - len(forced))
            assert set(got) == top | forced


# ---- oracle ------------------------------------------------------------------------------------
def brute_probs(q: torch.Tensor, k: torch.Tensor, n: int) -> torch.Tensor:
    """[h, n_q, n] exact causal softmax probabilities, one head at a time."""
    n_q = q.shape[0]
    out = torch.zeros(H_KV * G, n_q, n)
    for i in range(H_KV * G):
        s = q[:, i] @ k[i // G].T / math.sqrt(D)
        for r in range(n_q):
            p = n - n_q + r
            out[i, r, : p + 1] = torch.softmax(s[r, : p + 1], 0)
    return out


@pytest.mark.parametrize("n,n_q,shared", [(200, 200, False), (230, 97, False), (230, 97, True)])
def test_oracle_prefill_selection_matches_brute_force(n, n_q, shared):
    """A list per KV head by its group's exact mass, or (``shared_list``) one for all by the mass of every head."""
    density, b = 0.3, 16
    q, k, v = rand_qkv(n, n_q)
    cfg = OracleConfig(density=density, block_size=b, shared_list=shared)
    sel = Oracle(model_cfg(), cfg).select_prefill(ctx_for(n, n_q), q, k, v)
    probs = brute_probs(q, k, n)
    qs = n - n_q
    for r, qb in enumerate(range(qs // b, (n - 1) // b + 1)):
        rows = slice(max(qb * b, qs) - qs, min(n, qb * b + b) - qs)
        for h in range(H_KV):
            p = (probs if shared else probs[h * G: h * G + G])[:, rows].sum((0, 1))
            mass = [float(p[j * b: j * b + b].sum()) for j in range(qb + 1)]
            got = rows_of(sel.indices[h, r: r + 1])[0]
            # Sink and diagonal are kept; the rest of the budget goes to the other blocks by exact mass.
            forced = {0, qb}
            rest = [j for j in range(qb + 1) if j not in forced]
            want = prefill_block_budgets(density, qb + 1, 2, b)[qb]
            assert set(got) == brute_topk(mass, rest, want - len(forced)) | forced


def test_oracle_decode_selection_matches_brute_force():
    density, n = 0.2, 173
    q, k, v = rand_qkv(n, 1)
    sel = Oracle(model_cfg(), OracleConfig(density=density)).select_decode(ctx_for(n, 1), q[0], k, v)
    probs = brute_probs(q, k, n)[:, 0]
    for h, row in enumerate(rows_of(sel.indices)):
        score = probs[h * G: h * G + G].sum(0).tolist()
        assert row == sorted(brute_topk(score, list(range(n - 1)), budget(density, n) - 1) | {n - 1})


# ---- streaming ---------------------------------------------------------------------------------
@pytest.mark.parametrize("density", [None, 0.25])
def test_streaming_selection_matches_formula(density):
    b, sinks_tok, window, n, n_q = 16, 20, 50, 333, 250
    cfg = StreamingConfig(density=density, block_size=b, sink_tokens=sinks_tok, window=window)
    m = Streaming(model_cfg(), cfg)
    q, k, v = rand_qkv(n, n_q)
    sel = m.select_prefill(ctx_for(n, n_q), q, k, v)
    sinks = -(-sinks_tok // b)  # 2 blocks
    for r, qb in enumerate(range((n - n_q) // b, (n - 1) // b + 1)):
        local = -(-window // b) if density is None else max(
            prefill_block_budgets(density, qb + 1, sinks + 1, b)[qb] - min(sinks, qb + 1), 1)
        want = {j for j in range(qb + 1) if j < sinks or j > qb - local}
        assert all(set(row) == want for row in rows_of(sel.indices[:, r]))
    for n_dec in (5, 21, 100, 333):
        sel = m.select_decode(ctx_for(n_dec, 1), q[0], k[:, :n_dec], v[:, :n_dec])
        s = min(sinks_tok, n_dec)
        local = window if density is None else max(budget(density, n_dec) - s, 1)
        want = sorted(set(range(s)) | set(range(max(0, n_dec - local), n_dec)))
        assert all(row == want for row in rows_of(sel.indices))


# ---- every method ------------------------------------------------------------------------------
@pytest.mark.parametrize("n,n_q", [(211, 211), (211, 70)])
def test_density_one_reproduces_dense(n, n_q):
    q, k, v = rand_qkv(n, n_q)
    ref = dense_attention(q, k, v)
    for m in methods(1.0):
        state: dict = {}
        out, pairs = m.prefill_seq(ctx_for(n, n_q, state), q, k, v)
        assert (out - ref).abs().max() < 1e-5, m.name
        assert pairs == causal_pairs(n_q, n) * H_KV
        o, keys = m.decode_seq(ctx_for(n, 1, state), q[-1], k, v)
        assert (o - ref[-1]).abs().max() < 1e-5, m.name
        assert keys == n * H_KV


@pytest.mark.parametrize("density", [None, 0.1, 0.4])
def test_selections_are_causal_deduplicated_and_keep_sinks_and_local(density):
    b = 16
    for n, n_q in [(1, 1), (16, 16), (17, 17), (300, 300), (300, 41)]:
        q, k, v = rand_qkv(n, n_q)
        qbs = list(range((n - n_q) // b, (n - 1) // b + 1))
        for m in methods(density, b):
            sel = m.select_prefill(ctx_for(n, n_q), q, k, v)
            assert sel.indices.shape[:2] == (H_KV, len(qbs)) and sel.block_size == b
            assert_well_formed(sel.indices, qbs)
            assert all(row[0] == 0 and row[-1] == qb for row, qb in zip(rows_of(sel.indices), qbs * H_KV,
                                                                        strict=True))
            tsel = m.select_decode(ctx_for(n, 1), q[-1], k, v)
            unit = tsel.block_size
            assert_well_formed(tsel.indices, [(n - 1) // unit])
            # Decode: every method keeps the newest key; all but the oracle (exact top-k besides it) the sink.
            assert all((row[0] == 0 or m.name == "oracle") and row[-1] == (n - 1) // unit
                       for row in rows_of(tsel.indices))


def test_real_density_is_near_the_budget():
    n, b = 640, 16
    q, k, v = rand_qkv(n)
    causal = causal_pairs(n, n) * H_KV
    for density in (0.1, 0.3):
        for m in methods(density, b):
            state: dict = {}
            _, pairs = m.prefill_seq(ctx_for(n, n, state), q, k, v)
            assert abs(pairs / causal - density) < 0.15 * density + 0.01, (m.name, density, pairs / causal)
            _, keys = m.decode_seq(ctx_for(n, 1, state), q[-1], k, v)
            assert abs(keys / (n * H_KV) - density) < 0.02, (m.name, density)


def test_registered_and_run_on_a_ragged_batch_through_the_cache():
    cfg = model_cfg()
    lens = [300, 97]
    for name in ("streaming", "quest", "oracle"):
        backend = create_backend(name, cfg, density=0.8, block_size=16)  # 0.4 at the one sparse layer of 3
        dense_backend = create_backend(name, cfg, density=1.0, block_size=16, dense_layers=())
        with pytest.raises(ValueError):
            create_backend(name, cfg, no_such_param=1)
        for be in (backend, dense_backend):
            cache = KVCache(cfg, num_pages=40, page_size=16, num_kv_heads=H_KV)
            for i, n in enumerate(lens):
                cache.allocate(i, n + 2)
            qs, refs = [], []
            for step, q_lens in enumerate([lens, [1, 1]]):
                batch = cache.prepare([0, 1], q_lens, step == 0)
                q, k, v = rand_qkv(sum(q_lens))
                cache.write(2, k.transpose(0, 1), v.transpose(0, 1), batch)
                out = be.prefill(2, q, cache, batch) if step == 0 else be.decode(2, q, cache, batch)
                assert out.shape == q.shape and torch.isfinite(out).all()
                qs.append(out)
                refs.append(torch.cat([dense_attention(q[batch.cu_q[i]: batch.cu_q[i + 1]],
                                                       *cache.gather(2, batch, i)) for i in range(2)]))
            if be is dense_backend:
                assert all((a - r).abs().max() < 1e-5 for a, r in zip(qs, refs, strict=True))
                assert be.meter.per_layer()[2] == 1.0
            else:
                assert 0.2 < be.meter.per_layer()[2] < 0.9


def test_configs_are_validated():
    for cls, kw in [(StreamingConfig, {"window": 0}), (StreamingConfig, {"sink_tokens": -1}),
                    (StreamingConfig, {"block_size": 3}), (StreamingConfig, {"density": 0.0}),
                    (QuestConfig, {"page_size": 3}), (QuestConfig, {"page_size": 128}),
                    (OracleConfig, {"density": 1.5})]:
        with pytest.raises(ValueError):
            cls(**kw)
    assert StreamingConfig().density is None and StreamingConfig().window == 2048


def test_host_row_budget_is_row_budget():
    """The host form of the budget rule gives the tensor form's budget for every row: random densities and
    lengths, and products that land half-way (density 0.1 at 25 units, 0.5 at odd counts)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    dens = torch.rand(64, generator=g, dtype=torch.float64).tolist() + [0.1, 0.5, 0.3, 1e-9, 1.0]
    units = torch.randint(0, 20000, (200,), generator=g).tolist() + [0, 1, 5, 25, 35, 45, 2**20 + 1]
    for d in dens:
        want = row_budget(d, torch.tensor(units)).tolist()
        assert [host_row_budget(d, n) for n in units] == want, d
