"""SpecAttn against independent brute-force oracles.

Top-p is checked against a sort-and-cumsum nucleus in float64, the layer map's DTW against an exhaustive
enumeration of every monotone map, chunk rounding and the verifier's sparse attention against explicit
loops, and the whole speculative loop against plain greedy decoding of the same tiny random Llama.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from helpers import fresh_cache, random_state, tiny_hf_config

from raysparse.attention import DenseAttention, dense_attention
from raysparse.cli.specattn_map import main as specattn_map_main
from raysparse.config import ModelConfig
from raysparse.generate import FinishEvent, GenerationRequest, Generator, TokenEvent
from raysparse.kv_cache import KVCache
from raysparse.loader import model_from_state
from raysparse.methods.registry import create_backend
from raysparse.methods.selection import SENTINEL, indices_from_mask
from raysparse.sampling import SamplingParams
from raysparse.specattn import (
    LayerMap,
    SpecAttn,
    SpecAttnConfig,
    SpecAttnGenerator,
    compute_layer_map,
    load_layer_map,
    monotone_dtw,
    resolve_layer_map,
    round_to_chunks,
    save_layer_map,
    topp_mask,
)
from raysparse.specattn.draft import default_draft_layers
from raysparse.specattn.dtw import kl_similarity
from raysparse.specattn.layer_map import nearest_below_map
from raysparse.specattn.topp import union_topp
from raysparse.specattn.verify import verify_attention


@pytest.fixture(autouse=True)
def fresh_seed():
    """Fresh random inputs on every run; the seed is printed (shown when a test fails) to replay it."""
    print(f"torch seed {torch.seed()}")


# ---- top-p ---------------------------------------------------------------------------------------
def brute_nucleus(a: list[float], p: float) -> tuple[set[int], float]:
    """The minimal threshold set by sorting: add weights from the largest until the mass reaches p; every
    weight equal to the last one added joins too (ties). Returns (set, theta*)."""
    total = math.fsum(a)
    order = sorted(range(len(a)), key=lambda i: -a[i])
    acc = 0.0
    for i in order:
        acc += a[i]
        if acc >= p * total:
            theta = a[i]
            return {j for j, x in enumerate(a) if x >= theta and x > 0}, theta
    return {j for j, x in enumerate(a) if x > 0}, min((x for x in a if x > 0), default=0.0)


def random_weights(n: int, kind: int) -> torch.Tensor:
    if kind == 0:  # peaked, softmax-like
        return torch.softmax(torch.randn(n) * 3, dim=0)
    if kind == 1:  # flat with zeros
        return torch.rand(n) * (torch.rand(n) > 0.3)
    return torch.randint(0, 6, (n,)).float()  # many ties, unnormalised


def test_topp_is_the_minimal_set_up_to_the_search_resolution():
    for trial in range(60):
        n = int(torch.randint(1, 300, ()))
        a = random_weights(n, trial % 3)
        p = float(torch.empty(()).uniform_(0.05, 0.999))
        got = topp_mask(a, p)
        vals = a.double().tolist()
        want, theta = brute_nucleus(vals, p)
        chosen = set(torch.nonzero(got).flatten().tolist())
        assert math.fsum(vals[i] for i in chosen) >= p * math.fsum(vals) * (1 - 1e-6)
        assert want <= chosen  # contains the minimal threshold set
        slack = max(vals) / 2**10 * (1 + 1e-6)
        assert all(vals[i] >= theta - slack for i in chosen - want)  # extras lie within the resolution
        # with enough iterations the bisection lands exactly on the brute-force set
        assert set(torch.nonzero(topp_mask(a.double(), p, iters=80)).flatten().tolist()) == want


def test_topp_exact_on_separated_weights_ties_and_edges():
    for _ in range(40):  # distinct weights further apart than max / 1024: 10 iterations are exact
        n = int(torch.randint(2, 200, ()))
        a = (torch.randperm(n) + 1).float() * 8.0
        p = float(torch.empty(()).uniform_(0.01, 0.99))
        want, _ = brute_nucleus(a.tolist(), p)
        assert set(torch.nonzero(topp_mask(a, p)).flatten().tolist()) == want
    a = torch.tensor([0.0, 5.0, 1.0, 5.0, 0.0])  # tied maxima, each alone enough: both are kept
    assert topp_mask(a, 0.4).tolist() == [False, True, False, True, False]
    assert topp_mask(a, 1.0).tolist() == [False, True, True, True, False]  # p = 1: every positive weight
    assert not topp_mask(torch.zeros(4), 0.9).any()
    rows = torch.rand(3, 2, 50)  # batched over leading dims: each row on its own
    batched = topp_mask(rows, 0.8)
    for i, j in itertools.product(range(3), range(2)):
        assert torch.equal(batched[i, j], topp_mask(rows[i, j], 0.8))
    with pytest.raises(ValueError):
        topp_mask(a, 0.0)


def test_chunk_rounding_and_step_union_match_loops():
    for _ in range(20):
        n, chunk = int(torch.randint(1, 90, ())), int(torch.randint(1, 20, ()))
        mask = torch.rand(3, n) < 0.1
        want = torch.zeros_like(mask)
        for h in range(3):
            for i in range(n):
                c0 = i // chunk * chunk
                want[h, i] = bool(mask[h, c0: c0 + chunk].any())
        assert torch.equal(round_to_chunks(mask, chunk), want)
    ctx, steps = 37, 4
    rows = [torch.softmax(torch.randn(2, ctx + s + 1) * 2, -1) for s in range(steps)]
    got = union_topp(rows, 0.7, ctx, 16)
    want = torch.zeros(2, ctx, dtype=torch.bool)
    for r in rows:
        want |= topp_mask(r, 0.7)[:, :ctx]
    assert torch.equal(got, round_to_chunks(want, 16))
    assert got.shape == (2, ctx)


# ---- DTW layer map -------------------------------------------------------------------------------
def test_monotone_dtw_is_optimal_over_every_monotone_map():
    for _ in range(25):
        m, n = int(torch.randint(1, 5, ())), int(torch.randint(1, 6, ()))
        s = torch.randn(m, n).double()
        if torch.rand(()) < 0.3:
            s = s.round()  # ties
        path, score = monotone_dtw(s)
        assert len(path) == n and all(0 <= i < m for i in path)
        assert all(a <= b for a, b in zip(path, path[1:], strict=False))
        assert math.isclose(score, sum(float(s[path[j], j]) for j in range(n)), abs_tol=1e-9)
        best = max(sum(float(s[f[j], j]) for j in range(n))
                   for f in itertools.combinations_with_replacement(range(m), n))
        assert math.isclose(score, best, abs_tol=1e-9)


def test_kl_similarity_against_a_direct_sum():
    v = torch.softmax(torch.randn(3, 2, 2, 9), -1)  # [L, R, h, n]
    d = torch.softmax(torch.randn(2, 2, 2, 9), -1)
    s = kl_similarity(v, d)
    for i, j in itertools.product(range(2), range(3)):
        kls = [sum(float(v[j, r, h, x]) * math.log(float(v[j, r, h, x]) / float(d[i, r, h, x])) for x in range(9))
               for r in range(2) for h in range(2)]
        assert math.isclose(float(s[i, j]), -sum(kls) / len(kls), rel_tol=1e-4, abs_tol=1e-6)
    assert float(kl_similarity(v, v[:1])[0, 0]) == pytest.approx(0.0, abs=1e-6)


# ---- the KV cache rollback -----------------------------------------------------------------------
def test_truncate_then_reappend_equals_never_appended():
    cfg = ModelConfig.from_hf(tiny_hf_config(num_kv_heads=2, group=2, layers=2))
    a, b = KVCache(cfg, num_pages=8, page_size=4), KVCache(cfg, num_pages=8, page_size=4)
    for c in (a, b):
        c.allocate(5, 20)
    k0, v0 = torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    k1, v1 = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    for c in (a, b):
        c.write(1, k0, v0, c.prepare([5], [7], True))
    a.write(1, torch.randn(5, 2, 16), torch.randn(5, 2, 16), a.prepare([5], [5], True))  # rejected tokens
    a.truncate(5, 7)
    assert a.seq_len(5) == 7
    ba, bb = a.prepare([5], [3], True), b.prepare([5], [3], True)
    assert torch.equal(ba.positions, bb.positions) and ba.ctx_lens == bb.ctx_lens == [10]
    a.write(1, k1, v1, ba)
    b.write(1, k1, v1, bb)
    for x, y in zip(a.gather(1, ba, 0), b.gather(1, bb, 0), strict=True):
        assert torch.equal(x, y)
    with pytest.raises(ValueError):
        a.truncate(5, 11)
    a.truncate(5, 0)
    assert a.seq_len(5) == 0 and a.free_pages == b.free_pages


# ---- the verifier's sparse attention -------------------------------------------------------------
def test_verify_attention_matches_a_masked_loop_and_dense_when_full():
    h_kv, g, d, n, n_q = 2, 3, 8, 29, 5
    q, k, v = torch.randn(n_q, h_kv * g, d), torch.randn(h_kv, n, d), torch.randn(h_kv, n, d)
    mask = torch.rand(h_kv, n) < 0.4
    mask[:, n - n_q:] = True
    out = verify_attention(q, k, v, indices_from_mask(mask))
    for r in range(n_q):
        pos = n - n_q + r
        for head in range(h_kv * g):
            kh = head // g
            keys = [j for j in range(pos + 1) if mask[kh, j]]
            w = torch.softmax(torch.stack([q[r, head] @ k[kh, j] / math.sqrt(d) for j in keys]), 0)
            want = sum(w[i] * v[kh, j] for i, j in enumerate(keys))
            torch.testing.assert_close(out[r, head], want, rtol=1e-5, atol=1e-5)
    full = indices_from_mask(torch.ones(h_kv, n, dtype=torch.bool))
    torch.testing.assert_close(verify_attention(q, k, v, full), dense_attention(q, k, v), rtol=1e-5, atol=1e-5)


# ---- end to end ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    hf = tiny_hf_config(num_kv_heads=2, group=2, layers=5)
    return model_from_state(hf, random_state(hf, seed=torch.seed() % 2**31).state_dict())


def _requests(max_new: int, lens=(37, 70, 9)) -> list[GenerationRequest]:
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    return [GenerationRequest(tuple(torch.randint(0, 97, (n,)).tolist()), params, str(i))
            for i, n in enumerate(lens)]


def _run(gen, requests) -> tuple[dict[str, tuple[int, ...]], dict[str, list[int]]]:
    done, streamed = {}, {}
    for ev in gen.generate(requests):
        if isinstance(ev, TokenEvent):
            streamed.setdefault(ev.request_id, []).append(ev.token_id)
        elif isinstance(ev, FinishEvent):
            assert ev.finish_reason == "length", ev.error
            done[ev.request_id] = ev.token_ids
    return done, streamed


def test_specattn_with_p1_decodes_exactly_greedy(tiny):
    reqs = _requests(23)
    want, _ = _run(Generator(tiny, fresh_cache(tiny, 512), DenseAttention(tiny.cfg.num_layers)), reqs)
    cache = fresh_cache(tiny, 512)
    with pytest.raises(ValueError, match="no density budget"):  # the budget is top_p
        create_backend("specattn", tiny.cfg, top_p=1.0, density=0.3)
    backend = create_backend("specattn", tiny.cfg, top_p=1.0)
    assert isinstance(backend, SpecAttn) and backend.speculative
    got, streamed = _run(SpecAttnGenerator(tiny, cache, backend), reqs)
    assert got == want
    assert {k: tuple(v) for k, v in streamed.items()} == want
    s = backend.stats
    assert s.rounds > 0 and 0 < s.drafted and s.accepted <= s.drafted
    assert s.kv_reduction == 0.0 and cache.free_pages == cache.num_pages


def test_specattn_sparse_runs_batched_and_reads_less(tiny):
    reqs = _requests(12, lens=(150, 9, 95))
    cache = fresh_cache(tiny, 512)
    backend = SpecAttn(tiny.cfg, SpecAttnConfig(top_p=0.3, gamma=3))
    got, _ = _run(SpecAttnGenerator(tiny, cache, backend), reqs)
    assert {k: len(v) for k, v in got.items()} == {"0": 12, "1": 12, "2": 12}
    s = backend.stats.to_dict()
    assert 0 < s["kv_reduction"] < 1 and s["kv_reduction_sparse"] > s["kv_reduction"]
    assert s["kv_read_fraction_per_layer"][:2] == [1.0, 1.0]  # the first two layers are dense
    assert 0 < backend.meter.overall() < 1 and cache.free_pages == cache.num_pages


class MaskedBackend(DenseAttention):
    """Brute force: sparse layers attend, per KV head, exactly the keys of a given boolean mask (plus the
    new tokens), causally, by masking full float64 scores."""

    def __init__(self, num_layers: int, masks: dict[int, torch.Tensor]) -> None:
        super().__init__(num_layers)
        self.masks = masks

    def prefill(self, layer, q, cache, batch):
        if layer not in self.masks:
            return super().prefill(layer, q, cache, batch)
        k, v = cache.gather(layer, batch, 0)
        n_q, h, d = q.shape
        h_kv, n = k.shape[0], k.shape[1]
        out = torch.empty_like(q)
        for head in range(h):
            kh = head // (h // h_kv)
            s = (q[:, head].double() @ k[kh].double().T) / math.sqrt(d)
            for r in range(n_q):
                pos = n - n_q + r
                allowed = [j <= pos and (j >= n - n_q or bool(self.masks[layer][kh, j])) for j in range(n)]
                s[r, ~torch.tensor(allowed)] = float("-inf")
            out[:, head] = (torch.softmax(s, -1) @ v[kh].double()).to(q.dtype)
        return out


def test_verification_attends_exactly_the_planned_chunks(tiny):
    """One verification step through the model equals a brute-force step whose sparse layers see only the
    draft's chunks (found here by sorting each row and looping over chunks) plus the new tokens."""
    backend = SpecAttn(tiny.cfg, SpecAttnConfig(top_p=0.6, chunk_size=4, dense_layers=(0,), search_iters=60))
    ctx_len, n_new, h_kv, L = 30, 4, tiny.num_kv_heads, tiny.cfg.num_layers
    rows = {d: [torch.softmax(torch.randn(h_kv, ctx_len + s + 1) * 3, -1) for s in range(n_new - 1)]
            for d in backend.needed_draft_layers()}
    masks = {}
    for j in range(1, L):
        sel = torch.zeros(h_kv, ctx_len + n_new, dtype=torch.bool)
        for r in rows[backend.layer_map.mapping[j]]:
            for h in range(h_kv):
                for i in brute_nucleus(r[h].double().tolist(), 0.6)[0]:
                    if i < ctx_len:
                        sel[h, i // 4 * 4: min(i // 4 * 4 + 4, ctx_len)] = True
        masks[j] = sel
    ids = torch.randint(0, 97, (ctx_len + n_new,))
    cache = fresh_cache(tiny, 64)
    cache.allocate(0, ctx_len + n_new)
    tiny(ids[:ctx_len], cache.prepare([0], [ctx_len], True), cache, DenseAttention(L))
    plan = backend.plan(0, ctx_len, n_new, rows)
    for j in range(1, L):
        for h in range(h_kv):
            listed = [int(x) for x in plan.tokens[j][h] if x != SENTINEL]
            assert listed == torch.nonzero(masks[j][h]).flatten().tolist() + list(range(ctx_len, ctx_len + n_new))
    got = tiny(ids[ctx_len:], cache.prepare([0], [n_new], True), cache, backend, all_logits=True)
    backend.clear_plans()
    cache.truncate(0, ctx_len)
    want = tiny(ids[ctx_len:], cache.prepare([0], [n_new], True), cache, MaskedBackend(L, masks), all_logits=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    s = backend.stats
    assert s.kv_held[0] == s.kv_read[0] == ctx_len * h_kv  # the dense layer reads the whole context
    assert s.kv_read[1] == float(masks[1][:, :ctx_len].sum())


@pytest.mark.parametrize("top_p", [0.6, 1.0])
def test_batched_verification_equals_the_per_sequence_reference(tiny, top_p):
    """A ragged verification step of three sequences (contexts and draft lengths differ) on the batched seam
    (each position a decode row over the paged cache, no gather) gives the per-sequence reference's logits,
    the same density and the same KV reads; the reference runs when a tracer watches the backend."""
    h_kv, L = tiny.num_kv_heads, tiny.cfg.num_layers
    ctx, new = [37, 70, 5], [4, 2, 3]

    def step(traced: bool):
        backend = SpecAttn(tiny.cfg, SpecAttnConfig(top_p=top_p, chunk_size=4, dense_layers=(0,), search_iters=60))
        if traced:
            backend.tracer = lambda *a, **k: None
        g = torch.Generator().manual_seed(seed)
        cache = fresh_cache(tiny, 256)
        ids = [torch.randint(0, 97, (c + m,), generator=g) for c, m in zip(ctx, new, strict=True)]
        for sid, (c, m) in enumerate(zip(ctx, new, strict=True)):
            cache.allocate(sid, c + m)
            tiny(ids[sid][:c], cache.prepare([sid], [c], True), cache, DenseAttention(L))
            rows = {d: [torch.softmax(torch.randn(h_kv, c + s + 1, generator=g) * 3, -1) for s in range(m - 1)]
                    for d in backend.needed_draft_layers()}
            backend.plan(sid, c, m, rows)
        batch = cache.prepare([0, 1, 2], new, True)
        tail = torch.cat([ids[sid][c:] for sid, c in enumerate(ctx)])
        logits = tiny(tail, batch, cache, backend, all_logits=True)
        assert traced or batch.extras.get(("plan", id(backend))) is not None  # the seam's rows were planned
        return logits, backend

    seed = int(torch.randint(0, 2**31 - 1, ()))
    (got, b_got), (want, b_want) = step(False), step(True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"seed {seed}: {m}")
    assert b_got.meter.attended == pytest.approx(b_want.meter.attended)
    assert b_got.meter.decode_causal == pytest.approx(b_want.meter.decode_causal)
    assert b_got.stats.kv_read == pytest.approx(b_want.stats.kv_read)
    assert b_got.stats.kv_held == pytest.approx(b_want.stats.kv_held)
    if top_p < 1:
        assert sum(b_got.stats.kv_read) < sum(b_got.stats.kv_held)


def test_layer_map_measured_saved_and_loaded(tiny, tmp_path):
    L = tiny.cfg.num_layers
    windows = [torch.randint(0, 97, (40,)).tolist(), torch.randint(0, 97, (33,)).tolist()]
    lm = compute_layer_map(tiny, windows, steps=3, source="random")
    assert lm.draft_layers == default_draft_layers(L) and len(lm.mapping) == L
    assert all(a <= b for a, b in zip(lm.mapping, lm.mapping[1:], strict=False))
    assert lm.mapping[0] == 0  # draft layer 0 is verifier layer 0 on the same cache: KL 0
    sim = torch.tensor(lm.similarity)
    assert sim.shape == (len(lm.draft_layers), L) and float(sim[0, 0]) == pytest.approx(0.0, abs=1e-5)
    path = save_layer_map(lm, model_dir=tmp_path)
    assert path.parent == tmp_path and json.loads(path.read_text())["map"] == list(lm.mapping)
    assert load_layer_map(model_dir=tmp_path, num_layers=L, draft_layers=lm.draft_layers) == lm
    with pytest.raises(ValueError, match="draft layers"):
        load_layer_map(model_dir=tmp_path, draft_layers=(0, 1))
    assert load_layer_map(path=tmp_path / "none.json") is None
    assert resolve_layer_map(tiny, tmp_path, compute=False) == lm
    assert resolve_layer_map(tiny, tmp_path / "empty", compute=False) == nearest_below_map(L, lm.draft_layers)
    assert default_draft_layers(30) == tuple(range(10)) + tuple(range(20, 30))  # the middle third is skipped
    assert default_draft_layers(5) == (0, 1, 3, 4) and default_draft_layers(2) == (0, 1)
    backend = SpecAttn(tiny.cfg)
    backend.set_layer_map(lm)
    with pytest.raises(ValueError):
        backend.set_layer_map(nearest_below_map(L, (0, 2)))
    with pytest.raises(ValueError, match="monotone"):
        LayerMap(L, lm.draft_layers, (0, 3, 1, 3, 4))


def test_map_command_bad_input_is_one_line(tmp_path, capsys):
    assert specattn_map_main(["--model", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("raysparse specattn-map: error:") and "\n" not in err
    with pytest.raises(SystemExit) as e:
        specattn_map_main(["--tokens", "zero"])
    assert e.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_shard_executor_verifies_a_round_through_the_backend():
    """``ShardExecutor.verify`` reaches SpecAttn through the backend's ``verify_round`` (the executor imports
    nothing of SpecAttn): with p = 1 a draft of the verifier's own greedy tokens is accepted whole, a draft
    wrong at its second token is cut there and the cache rolled back, and rank 0's acceptance statistics are
    reported under the method's name."""
    from dataclasses import asdict

    from raysparse.shard_executor import ShardExecutor
    from raysparse.specattn.verify import VerifyPlan
    from raysparse.specattn.wire import pack_round
    from raysparse.step_plan import StepPlan, method_key

    cfg = tiny_hf_config(layers=3)
    model = model_from_state(cfg, random_state(cfg, seed=11).state_dict())
    params = asdict(SamplingParams(max_new_tokens=8, ignore_eos=True))
    prompt = [5, 9, 2, 7, 11, 3, 40, 41]
    ref, dense = ShardExecutor(model, fresh_cache(model, 256)), method_key("dense")
    greedy = [ref.execute(StepPlan(dense, True, [0], [prompt], admit=[(0, 32, params)]))["tokens"][0]]
    for _ in range(4):
        greedy.append(ref.execute(StepPlan(dense, False, [0], [[greedy[-1]]]))["tokens"][0])
    assert "dense" not in ref.stats()  # a method without statistics of its own reports none

    ex, key = ShardExecutor(model, fresh_cache(model, 256)), method_key("specattn", {"top_p": 1.0, "gamma": 3})
    first = ex.execute(StepPlan(key, True, [0, 1], [prompt, prompt], admit=[(0, 32, params), (1, 32, params)]))
    assert first["tokens"] == [greedy[0], greedy[0]], first["error"]
    backend = ex.backend(key)
    wrong = (greedy[2] + 1) % cfg.vocab_size
    drafts = [greedy[1:4], [greedy[1], wrong, greedy[3]]]
    plans = [VerifyPlan(len(prompt), 4, True), VerifyPlan(len(prompt), 4, True)]
    sparse_map = {j: backend.layer_map.mapping[j] for j in backend.stats.sparse_layers}
    msg = pack_round(drafts, plans, sparse_map, backend.config.chunk_size)
    res = ex.verify(StepPlan(key, False, [0, 1], [[greedy[0]], [greedy[0]]]), msg)
    assert res["error"] is None and res["tokens"] == [greedy[1:5], greedy[1:3]]
    assert [ex.cache.seq_len(s) for s in (0, 1)] == [len(prompt) + 4, len(prompt) + 2]
    st = ex.stats()["specattn"][key]
    assert (st["rounds"], st["drafted"], st["accepted"]) == (2, 6, 4)
    bad = ex.verify(StepPlan(dense, False, [0], [[greedy[0]]]), msg)  # dense has no verification rounds
    assert bad["tokens"] is None and "'dense' has no verification rounds" in bad["error"]
