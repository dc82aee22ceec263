"""SOCKET against independent brute force on fresh random inputs (no fixed seeds).

The oracles compute sign patterns with explicit per-hyperplane dot products, enumerate the 2**P corners
one by one, softmax in float64 Python, look each key's bucket up explicitly and pick top-k by sorting a
Python list.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import fresh_cache, random_state, tiny_hf_config

from raysparse.attention import DenseAttention
from raysparse.config import ModelConfig
from raysparse.generate import GenerationRequest, Generator
from raysparse.loader import model_from_state
from raysparse.methods.budget import row_budget
from raysparse.methods.registry import get_method
from raysparse.methods.selection import SENTINEL
from raysparse.methods.socket import Socket, SocketConfig, SocketHard, SocketHardConfig
from raysparse.methods.views import SeqContext
from raysparse.sampling import SamplingParams

H_KV, G, D = 2, 3, 16


def rand_int(lo: int, hi: int) -> int:
    return int(torch.randint(lo, hi, ()).item())


def model_cfg(layers: int = 3, kv: int = H_KV, g: int = G, d: int = D) -> ModelConfig:
    return ModelConfig(97, kv * g * d, 80, layers, kv * g, kv, d, 1e-5, 4096, False)


def method(**kw) -> Socket:
    kw = {"tables": 5, "planes": 4, "sink_tokens": 4, "local_tokens": 4, "dense_layers": (),
          "seed": rand_int(0, 2**31), **kw}
    return Socket(model_cfg(), SocketConfig(**kw))


def rand_qkv(n: int):
    k = torch.randn(H_KV, n, D) * 1.5
    v = torch.randn(H_KV, n, D) * torch.rand(H_KV, n, 1) * 3  # varied value norms
    q = torch.randn(H_KV * G, D) * 2 + 0.3
    return q, k, v


def ctx_for(n: int, state: dict, n_q: int = 1, layer: int = 2) -> SeqContext:
    return SeqContext(layer, 0, n - n_q, n, state)


def indexed(m: Socket, n: int, layer: int = 2):
    """Fresh inputs after a dense prefill over all n keys, with the reference hash index built."""
    q, k, v = rand_qkv(n)
    state: dict = {}
    m.prefill_seq(ctx_for(n, state, n, layer), torch.randn(n, H_KV * G, D), k, v)
    m.update_index(ctx_for(n, state, n, layer), k, v)  # the reference index is built lazily: build it now
    return q, k, v, state


def explicit_bucket(w: list[list[float]], x: list[float]) -> int:
    """Bucket id from the sign pattern: bit p set iff the p-th hyperplane's dot product is positive."""
    return sum(1 << p for p, plane in enumerate(w) if sum(a * b for a, b in zip(plane, x, strict=True)) > 0)


def brute_scores(m: Socket, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[list[float]]:
    """the paper's formula, loop by loop: explicit corners, softmax, bucket lookup; float64 Python."""
    c = m.config
    w = m.planes_for(layer, H_KV, torch.device("cpu")).double().tolist()  # [h, L, P, d]
    corners = [[1.0 if (r >> p) & 1 else -1.0 for p in range(c.planes)] for r in range(1 << c.planes)]
    out = []
    for h in range(H_KV):
        probs = []  # per table: the group-reduced distribution over buckets
        for tbl in range(c.tables):
            per_head = []
            for i in range(h * G, h * G + G):
                qi = q[i].double().tolist()
                if c.hard:
                    b = explicit_bucket(w[h][tbl], qi)
                    per_head.append([1.0 if r == b else 0.0 for r in range(len(corners))])
                    continue
                u = [math.tanh(sum(a * b for a, b in zip(plane, qi, strict=True))) / math.sqrt(D)
                     for plane in w[h][tbl]]
                logits = [sum(up * cp for up, cp in zip(u, cr, strict=True)) / c.tau for cr in corners]
                mx = max(logits)
                e = [math.exp(x - mx) for x in logits]
                per_head.append([x / sum(e) for x in e])
            red = (lambda xs: sum(xs) / len(xs)) if c.group_reduce == "mean" else max
            probs.append([red([ph[r] for ph in per_head]) for r in range(len(corners))])
        row = []
        for j in range(k.shape[1]):
            kj = k[h, j].double().tolist()
            s = sum(probs[tbl][explicit_bucket(w[h][tbl], kj)] for tbl in range(c.tables))
            row.append(s if c.hard or not c.value_norm else s * float(v[h, j].double().norm()))
        out.append(row)
    return out


def budget(density: float, n: int) -> int:
    """The repo-wide budget rule (``row_budget``): round(density * n), at least 1."""
    return int(row_budget(density, torch.tensor(n)))


def rows_of(indices: torch.Tensor) -> list[list[int]]:
    return [[int(x) for x in row if x != SENTINEL] for row in indices]


# ---- hashing -----------------------------------------------------------------------------------
@pytest.mark.parametrize("planes,dtype", [(8, torch.uint8), (10, torch.int16)])
def test_bucket_ids_are_the_explicit_sign_patterns(planes, dtype):
    m = method(planes=planes, tables=3)
    n = rand_int(20, 40)
    _, k, v, state = indexed(m, n)
    ids = state["socket_buckets"]
    assert ids.dtype == dtype and ids.shape == (H_KV, 3, n)
    w = m.planes_for(2, H_KV, torch.device("cpu")).double().tolist()
    for h in range(H_KV):
        for tbl in range(3):
            want = [explicit_bucket(w[h][tbl], k[h, j].double().tolist()) for j in range(n)]
            assert ids[h, tbl].tolist() == want
    torch.testing.assert_close(state["socket_vnorm"], torch.stack([v[h].norm(dim=-1) for h in range(H_KV)]))


def test_hyperplanes_are_gaussian_fixed_per_seed_layer_and_global_head():
    seed = rand_int(0, 2**31)
    a = Socket(model_cfg(), SocketConfig(seed=seed, tables=4, planes=6))
    b = Socket(model_cfg(), SocketConfig(seed=seed, tables=4, planes=6))
    wa = a.planes_for(1, H_KV, torch.device("cpu"))
    assert wa.shape == (H_KV, 4, 6, D) and torch.equal(wa, b.planes_for(1, H_KV, torch.device("cpu")))
    assert not torch.equal(wa, a.planes_for(2, H_KV, torch.device("cpu")))  # per layer
    assert not torch.equal(wa[0], wa[1])  # per head
    b.kv_head_offset = 1  # a tensor-parallel shard holding global head 1 alone
    assert torch.equal(b.planes_for(1, 1, torch.device("cpu"))[0], wa[1])
    big = Socket(model_cfg(), SocketConfig(seed=seed)).planes_for(0, H_KV, torch.device("cpu"))
    assert abs(float(big.mean())) < 0.02 and abs(float(big.std()) - 1) < 0.02


def test_appended_and_rolled_back_keys_hash_like_a_rebuild_from_scratch():
    m = method(planes=8, tables=6)
    n0, n_end = rand_int(5, 30), 120
    q, k, v = rand_qkv(n_end + 16)
    state: dict = {}
    m.prefill_seq(ctx_for(n0, state, n0), torch.randn(n0, H_KV * G, D), k[:, :n0], v[:, :n0])
    n = n0
    while n < n_end:
        n = min(n_end, n + rand_int(1, 6))  # several keys may arrive between calls
        m.select_decode(ctx_for(n, state), q, k[:, :n], v[:, :n])
        assert state["socket_n"] == n
        scratch: dict = {}
        ids, norms = m.update_index(ctx_for(n, scratch, n), k[:, :n], v[:, :n])
        assert torch.equal(state["socket_buckets"][:, :, :n], ids)
        assert torch.equal(state["socket_vnorm"][:, :n], norms)
    assert state["socket_vnorm"].shape[1] < 1.2 * n_end + 64  # bounded growth slack
    # Speculative rollback: the cache drops the last r tokens and new keys take their slots; the next
    # verification step (r + 3 tokens, through the prefill path) reaches past the old hashed length.
    r = rand_int(2, 7)
    cut, n = n_end - r, n_end + 3
    k2, v2 = k.clone(), v.clone()
    k2[:, cut:], v2[:, cut:] = torch.randn_like(k2[:, cut:]), torch.randn_like(v2[:, cut:])
    m.prefill_seq(ctx_for(n, state, n - cut), torch.randn(n - cut, H_KV * G, D), k2[:, :n], v2[:, :n])
    m.select_decode(ctx_for(n + 1, state), q, k2[:, : n + 1], v2[:, : n + 1])
    ids, norms = m.update_index(ctx_for(n + 1, {}, n + 1), k2[:, : n + 1], v2[:, : n + 1])
    assert torch.equal(state["socket_buckets"][:, :, : n + 1], ids)
    assert torch.equal(state["socket_vnorm"][:, : n + 1], norms)


# ---- scores ------------------------------------------------------------------------------------
@pytest.mark.parametrize("planes,reduce,hard,vnorm", [(4, "mean", False, True), (4, "max", False, True),
                                                      (3, "mean", True, True), (4, "max", True, True),
                                                      (8, "mean", False, True), (4, "mean", False, False)])
def test_scores_match_the_loop_formula(planes, reduce, hard, vnorm):
    m = method(planes=planes, tables=3 if planes == 8 else 5, group_reduce=reduce, hard=hard, value_norm=vnorm,
               tau=float(torch.empty(()).uniform_(0.1, 1.0)))
    n = rand_int(20, 45)
    q, k, v, state = indexed(m, n)
    got = m.scores(ctx_for(n, state), q, k, v)
    want = torch.tensor(brute_scores(m, 2, q, k, v), dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    # The scorer reads only bucket ids and value norms: garbage K/V give the same scores.
    # The scorer reads only bucket ids and value norms: garbage in every key and value but the new
    # token's (which decode hashes) gives the same scores.
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :-1], v_bad[:, :-1] = float("nan"), float("nan")
    assert torch.equal(m.scores(ctx_for(n, state), q, k_bad, v_bad), got)


def test_soft_lsh_beats_hard_lsh_on_top_k_recall_of_gaussian_keys():
    """The paper's Fig. 2 setting: Gaussian q and keys, truth = top-k inner products, unit values."""
    n, top, d, trials = 1000, 50, 64, 6
    cfg = model_cfg(layers=1, kv=2, g=1, d=d)
    recall = {False: 0.0, True: 0.0}
    for _ in range(trials):
        k, q = torch.randn(2, n, d), torch.randn(2, d)
        v = torch.nn.functional.normalize(torch.randn(2, n, d), dim=-1)
        truth = [set(torch.topk(k[h] @ q[h], top).indices.tolist()) for h in range(2)]
        seed = rand_int(0, 2**31)
        for hard in (False, True):
            m = Socket(cfg, SocketConfig(hard=hard, top_k=top, sink_tokens=0, local_tokens=0, seed=seed))
            sel = rows_of(m.select_decode(ctx_for(n, {}, layer=0), q, k, v).indices)
            recall[hard] += sum(len(truth[h] & set(sel[h])) / top for h in range(2)) / (2 * trials)
    assert recall[False] > recall[True] + 0.1, recall
    assert recall[False] > 4 * top / n, recall  # far above chance


# ---- selection ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [{"density": 0.3}, {"top_k": 7}, {"top_k": 0}, {"top_k": 10**6},
                                {"density": 0.05, "hard": True}])
def test_selection_is_deduplicated_ascending_keeps_sink_local_and_respects_budget(kw):
    for n in (1, 6, 9, 40, rand_int(60, 300)):
        m = method(**kw)
        q, k, v, state = indexed(m, n)
        scores = m.scores(ctx_for(n, dict(state)), q, k, v).tolist()
        sel = m.select_decode(ctx_for(n, state), q, k, v)
        assert sel.indices.dtype == torch.int32 and sel.block_size == 1
        sink, local = min(4, n), min(4, n - min(4, n))
        if "top_k" in kw:
            k_want = kw["top_k"]
        else:  # the density's budget holds the forced tokens too, at most forced_share of it
            b = budget(kw["density"], n)
            cap = math.floor(b * m.config.forced_share)
            if cap < sink + local:
                sink = min(sink, cap // 2)
                local = min(4, n - sink, cap - sink)
            k_want = b - sink - local
        k_want = max(0, min(k_want, n - sink - local))
        assert sel.indices.shape == (H_KV, sink + local + k_want)  # fixed width = the budget, no padding
        for h, row in enumerate(rows_of(sel.indices)):
            assert row == sorted(set(row)) and len(row) == sel.indices.shape[1]
            assert set(range(sink)) | set(range(n - local, n)) <= set(row)
            cand = list(range(sink, n - local))
            top = sorted(cand, key=lambda j: (-scores[h][j], j))[:k_want]
            assert set(row) == set(range(sink)) | set(range(n - local, n)) | set(top)
        out, counted = m.decode_seq(ctx_for(n, state), q, k, v)
        assert counted == H_KV * sel.indices.shape[1]
        for h, row in enumerate(rows_of(sel.indices)):  # exact softmax attention over the union
            for i in range(h * G, h * G + G):
                p = torch.softmax(k[h, row] @ q[i] / math.sqrt(D), 0)
                torch.testing.assert_close(out[i], p @ v[h, row], rtol=1e-5, atol=1e-5)


def test_density_budget_counts_sink_and_local():
    m = Socket(model_cfg(), SocketConfig())  # defaults: density 0.1, sink 128, local 128, forced share 0.25
    assert m.budget(12000) == (128, 128, 944)  # a budget of 1200: the paper's forced tokens whole
    assert m.budget(6000) == (75, 75, 450)  # they would take more than a quarter: they shrink to a quarter
    assert m.budget(3000) == (37, 38, 225)  # in proportion to their sizes, the rounding to the local window
    assert m.budget(200) == (2, 3, 15)
    assert Socket(model_cfg(), SocketConfig(sink_tokens=30, local_tokens=90)).budget(1000) == (6, 19, 75)
    half = Socket(model_cfg(), SocketConfig(forced_share=0.5))
    assert half.budget(6000) == (128, 128, 344)
    assert half.budget(3000) == (75, 75, 150)
    assert half.budget(1000) == (25, 25, 50)
    assert Socket(model_cfg(), SocketConfig(sink_tokens=30, local_tokens=90, forced_share=0.5)).budget(1000) == (
        12, 38, 50)
    whole = Socket(model_cfg(), SocketConfig(forced_share=1.0))  # they shrink only to the whole budget
    assert whole.budget(3000) == (128, 128, 44)
    assert whole.budget(1000) == (50, 50, 0)
    assert Socket(model_cfg(), SocketConfig(top_k=500)).budget(3000) == (128, 128, 500)
    assert Socket(model_cfg(), SocketConfig(top_k=5)).budget(1000) == (128, 128, 5)  # the paper's k: on top
    share = SocketConfig(forced_share=float(torch.rand(()) * 0.9 + 0.1))
    for cfg in (SocketConfig(), SocketConfig(forced_share=1.0), share):
        m = Socket(model_cfg(), cfg)
        ks = []
        for n in range(1, 8000, 7):  # the device rule equals the host one
            got = [int(t) for t in m._budget_rows(torch.tensor([[n]]))]
            assert tuple(got) == m.budget(n), (cfg.forced_share, n)
            assert sum(m.budget(n)) == budget(0.1, n), (cfg.forced_share, n)  # the attended tokens are the budget
            ks.append(got[2])
        # k never falls as n grows: the bucket's k bounds every shorter row's (the decode's list width)
        assert all(a <= b for a, b in zip(ks, ks[1:], strict=False)), cfg.forced_share


def test_forced_share_is_validated():
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="forced_share"):
            SocketConfig(forced_share=bad)
    with pytest.raises(ValueError, match="probs"):
        SocketConfig(probs="bf16")


# ---- through the model -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model():
    hf_cfg = tiny_hf_config(layers=3)
    return model_from_state(hf_cfg, random_state(hf_cfg, seed=rand_int(0, 10_000)).state_dict())


def run_steps(model, backend, prompts: list[list[int]], steps: int):
    """A ragged prefill then greedy decode steps; the logits of every step and the cache."""
    cache = fresh_cache(model, 1024, page_size=16)
    for i, p in enumerate(prompts):
        cache.allocate(i, len(p) + steps)
    ids = torch.tensor([t for p in prompts for t in p])
    batch = cache.prepare(list(range(len(prompts))), [len(p) for p in prompts], True)
    out = [model(ids, batch, cache, backend, all_logits=True)]
    last = out[0][batch.last_token_rows()].argmax(-1)
    for _ in range(steps):
        batch = cache.prepare(list(range(len(prompts))), [1] * len(prompts), False)
        out.append(model(last, batch, cache, backend))
        last = out[-1].argmax(-1)
    return out, cache


def test_full_budget_decode_equals_dense_through_the_model(tiny_model):
    cfg = tiny_model.cfg
    prompts = [torch.randint(0, cfg.vocab_size, (rand_int(20, 40),)).tolist() for _ in range(2)]
    want, _ = run_steps(tiny_model, DenseAttention(3), prompts, 5)
    for cls, kw in [(Socket, {"top_k": 10**6}), (Socket, {"density": 1.0}),
                    (SocketHard, {"top_k": 10**6, "group_reduce": "max"})]:
        m = cls(cfg, cls.config_cls(dense_layers=(0,), sink_tokens=3, local_tokens=5, tables=8, **kw))
        got, cache = run_steps(tiny_model, m, prompts, 5)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
        assert m.meter.overall() == pytest.approx(1.0)
        assert not cache.metadata[0][0]  # the dense layer keeps no state
        # Decode scores from the per-page pools of the sparse layers only.
        assert {k[1][1] for k in cache.shared_state if k[0] == "page_pool" and k[1][0] == "socket"} == {1, 2}
    # Through the Generator too: greedy tokens identical to dense.
    reqs = [GenerationRequest(tuple(p), SamplingParams(6, ignore_eos=True), str(i)) for i, p in enumerate(prompts)]

    def tokens(backend) -> dict[str, tuple[int, ...]]:
        gen = Generator(tiny_model, fresh_cache(tiny_model, 1024, page_size=16), backend)
        return {ev.request_id: ev.token_ids for ev in gen.generate(reqs) if hasattr(ev, "finish_reason")}

    assert tokens(Socket(cfg, SocketConfig(density=1.0, sink_tokens=3, local_tokens=5, tables=8))) == tokens(
        DenseAttention(3))


def test_sparse_decode_density_through_the_model(tiny_model):
    cfg = tiny_model.cfg
    m = Socket(cfg, SocketConfig(density=0.3, dense_layers=(0,), sink_tokens=4, local_tokens=4, tables=8))
    prompts = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (rand_int(150, 250), rand_int(60, 120))]
    outs, _ = run_steps(tiny_model, m, prompts, 1)  # prefill (dense) + one decode step
    assert all(torch.isfinite(o).all() for o in outs)
    h_kv = cfg.num_kv_heads
    prefill = [sum(p * (p + 1) // 2 for p in map(len, prompts)) * h_kv] * 2
    decode = [sum(len(p) + 1 for p in prompts) * h_kv, sum(budget(0.3, len(p) + 1) for p in prompts) * h_kv]
    assert m.meter.attended[1:] == [float(prefill[0] + decode[1])] * 2
    assert m.meter.causal[1:] == [float(prefill[1] + decode[0])] * 2


# ---- config, registry, metadata ----------------------------------------------------------------
def test_config_registry_and_metadata_bytes():
    c = SocketConfig()
    assert (c.planes, c.tables, c.tau, c.sink_tokens, c.local_tokens, c.density, c.top_k, c.group_reduce,
            c.hard, c.value_norm, c.dense_layers) == (8, 60, 0.3, 128, 128, 0.1, None, "mean", False, False, (0, 1))
    for bad in ({"planes": 0}, {"planes": 16}, {"tables": 0}, {"tau": 0.0}, {"sink_tokens": -1},
                {"top_k": -1}, {"group_reduce": "sum"}, {"seed": -1}, {"density": 0.0}):
        with pytest.raises(ValueError):
            SocketConfig(**bad)
    soft = get_method("socket").factory(model_cfg(), density=0.8, tables=4, dense_layers=[0, 1])  # 0.4 at layer 2
    hard = get_method("socket_hard").factory(model_cfg(), top_k=16)
    assert isinstance(soft, Socket) and not soft.config.hard and soft.config.target_density == 0.8
    assert soft.config.density == pytest.approx(0.4)
    assert isinstance(hard, SocketHard) and hard.config.hard and hard.name == "socket_hard"
    with pytest.raises(ValueError):
        get_method("socket").factory(model_cfg(), bogus=1)
    m = Socket(model_cfg(layers=5), SocketConfig(value_norm=True))  # 3 sparse layers; the paper's scorer keeps norms
    assert m.metadata_bytes_per_token_per_layer() == H_KV * (60 + 4)
    assert m.metadata_bytes_per_token() == 3 * H_KV * 64
    assert m.metadata_bytes_per_token_per_layer(num_kv_heads=1) == 64
    wide = Socket(model_cfg(), SocketConfig(planes=10, value_norm=True))
    assert wide.metadata_bytes_per_token_per_layer() == H_KV * 124
    # the default scorer (no value-norm factor) and the hard counts keep only bucket ids
    assert Socket(model_cfg(layers=5), SocketConfig()).metadata_bytes_per_token() == 3 * H_KV * 60
    assert SocketHard(model_cfg(layers=5), SocketHardConfig()).metadata_bytes_per_token() == 3 * H_KV * 60


@pytest.mark.parametrize("planes,hard", [(4, False), (4, True), (11, False)])
def test_batch_bucket_probs_equal_the_per_row_distributions(monkeypatch: pytest.MonkeyPatch, planes: int,
                                                            hard: bool) -> None:
    """The batch's distributions (the one-launch kernel where it applies, the PyTorch form past its planes)
    equal ``bucket_probs`` of each row's query, every element."""
    m = method(planes=planes, hard=hard, tables=3)
    q = torch.randn(3, H_KV * G, D, device="cuda" if torch.cuda.is_available() else "cpu")  # compiled: device only
    want = torch.stack([m.bucket_probs(1, q[i], H_KV) for i in range(3)])
    for mode in ("torch", "triton"):
        monkeypatch.setenv("RAYSPARSE_KERNELS", mode)
        torch.testing.assert_close(m.batch_bucket_probs(1, q, H_KV), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("planes", [4, 11])
def test_fp16_stored_probs_are_the_fp32_distributions_rounded(monkeypatch: pytest.MonkeyPatch, planes: int) -> None:
    """``probs="fp16"``: the batch's distributions (kernel and PyTorch form) are the fp32 ones rounded to fp16,
    every element."""
    seed = rand_int(0, 2**31)
    m32, m16 = (method(planes=planes, tables=3, seed=seed, probs=p) for p in ("fp32", "fp16"))
    q = torch.randn(3, H_KV * G, D, device="cuda" if torch.cuda.is_available() else "cpu")
    for mode in ("torch", "triton"):
        monkeypatch.setenv("RAYSPARSE_KERNELS", mode)
        got = m16.batch_bucket_probs(1, q, H_KV)
        assert got.dtype == torch.float16
        assert torch.equal(got, m32.batch_bucket_probs(1, q, H_KV).half()), mode
