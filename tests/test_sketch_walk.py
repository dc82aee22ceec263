"""Sketch&Walk against independent brute-force oracles, on fresh random inputs (no fixed seeds).

The oracles build the Hadamard matrix from its closed form, average blocks with explicit loops over
tokens, walk with explicit per-row softmaxes in float64 and pick top blocks by sorting a Python list.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import fresh_cache, prefill_block_budgets, random_state, tiny_hf_config

from raysparse.attention import DenseAttention
from raysparse.config import ModelConfig
from raysparse.generate import GenerationRequest, Generator
from raysparse.kv_cache import KVCache
from raysparse.loader import model_from_state
from raysparse.methods import sketch_walk_reference
from raysparse.methods.hadamard import SRHT, derive_seed, fwht
from raysparse.methods.selection import SENTINEL
from raysparse.methods.sketch_walk import SketchWalk
from raysparse.methods.sketch_walk_config import GRAPH_DECODE, SketchWalkConfig
from raysparse.methods.sketch_walk_walk import walk_rows
from raysparse.methods.views import SeqContext
from raysparse.sampling import SamplingParams

BF16 = {"rtol": 2**-7, "atol": 2e-3}  # A_hat is stored in bf16


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These shapes are tiny: intra-op threads only spin, and on a loaded 2-core box that costs ~50x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rand_int(lo: int, hi: int) -> int:
    return int(torch.randint(lo, hi, ()).item())


def model_cfg(layers: int = 4, heads: int = 4, kv_heads: int = 2, head_dim: int = 24) -> ModelConfig:
    return ModelConfig(vocab_size=97, hidden_size=heads * head_dim, intermediate_size=80, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                       max_position_embeddings=4096, tie_word_embeddings=False)


def method(cfg: ModelConfig, **kw) -> SketchWalk:
    """the paper's scoring (head means, whole blocks) unless the test asks for another."""
    kw = {"block_size": 8, "sketch_dim": 16, "dense_layers": (0,), "seed": rand_int(0, 2**31), **GRAPH_DECODE, **kw}
    return SketchWalk(cfg, SketchWalkConfig(**kw))


def hadamard(d: int) -> torch.Tensor:
    """Sylvester Hadamard matrix from its closed form H[i, j] = (-1) ** popcount(i & j)."""
    i = torch.arange(d)
    both = i[:, None] & i[None, :]
    pop = sum((both >> bit) & 1 for bit in range(max(1, d.bit_length())))
    return (1 - 2 * (pop % 2)).double()


def explicit_srht(s: SRHT) -> torch.Tensor:
    """H_d = (D W)[:d, coords] * sqrt(d'/r) as an explicit float64 matrix."""
    dw = torch.diag(s.signs.double()) @ hadamard(s.padded) / math.sqrt(s.padded)
    return dw[: s.dim][:, s.coords] * s.scale


def random_qk(n: int, h: int, h_kv: int, d: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q [n, h, d], K [h_kv, n, d]: a random centre per block (so block scores spread) plus token noise."""
    nb = -(-n // b)
    blk = torch.arange(n) // b
    scale = 0.3 + torch.rand(())
    q = (torch.randn(nb, d) * scale)[blk][:, None] + torch.randn(n, h, d)
    k = (torch.randn(nb, d) * scale)[blk][None] + torch.randn(h_kv, n, d)
    return q, k


def head_query(q_t: torch.Tensor, h_kv: int, kv: int | None) -> torch.Tensor:
    """One token's query [h, d] averaged over every head (kv None) or over KV head kv's query group."""
    if kv is None:
        return q_t.double().mean(0)
    g = q_t.shape[0] // h_kv
    return q_t[kv * g: (kv + 1) * g].double().mean(0)


def brute_scores(q: torch.Tensor, k: torch.Tensor, H: torch.Tensor, b: int, kv: int | None = None):
    """Sketched block means and block-causal A_hat by explicit loops (float64); heads averaged (kv None) or
    KV head kv and its query group alone."""
    n, d, r = q.shape[0], q.shape[-1], H.shape[1]
    nb = -(-n // b)
    qt, kt = [], []
    for i in range(nb):
        lo, hi = i * b, min(n, (i + 1) * b)
        qbar, kbar = torch.zeros(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
        for t in range(lo, hi):
            qbar += head_query(q[t], k.shape[0], kv)
            kbar += k[:, t].double().mean(0) if kv is None else k[kv, t].double()
        qt.append(qbar / (hi - lo) @ H)
        kt.append(kbar / (hi - lo) @ H)
    a = torch.zeros(nb, nb, dtype=torch.float64)
    for i in range(nb):
        for j in range(i + 1):
            a[i, j] = qt[i] @ kt[j] / math.sqrt(r)
    return torch.stack(qt), torch.stack(kt), a


def brute_walk(scores: list[torch.Tensor], s: float, walk: str = "rollout", alpha: float = 0.5) -> list[torch.Tensor]:
    """R per layer from block scores: per-row causal softmax, ** s, then
    product: R = R W (W = P ** s); one-hop: R = W; rollout: R = R (alpha I + (1 - alpha) W / rowsum(W));
    rows renormalised after every layer."""
    out, rw = [], None
    for a in scores:
        nb = a.shape[0]
        w = torch.zeros(nb, nb, dtype=torch.float64)
        for i in range(nb):
            p = torch.softmax(a[i, : i + 1].double(), 0)
            w[i, : i + 1] = p**s
            if walk == "rollout":
                w[i] = (1 - alpha) * w[i] / w[i].sum()
                w[i, i] += alpha
        rw = w if rw is None or walk == "one-hop" else rw @ w
        rw = rw / rw.sum(1, keepdim=True)
        out.append(rw)
    return out


BLOCK = 8  # the block size of the tests that check selections against brute_select


def brute_select(row: torch.Tensor, qi: int, density: float, local: int = 1, prefill: bool = True) -> list[int]:
    """Sink, local and the top blocks by ``row`` up to the row's budget: a prefill row's
    (``prefill_block_budgets``), or a decode row's round(density * blocks)."""
    tau = (prefill_block_budgets(density, qi + 1, local + 1, BLOCK)[qi] if prefill
           else max(1, round(density * (qi + 1))))
    forced = {0} | set(range(max(0, qi - local + 1), qi + 1))
    rest = sorted(set(range(qi + 1)) - forced, key=lambda j: (-float(row[j]), j))
    return sorted(forced | set(rest[: max(0, tau - len(forced))]))


def assert_same_choice(got: list[int], want: list[int], row: torch.Tensor) -> None:
    """Equal sets, or sets that differ only by swapping near-tied scores (fp32 vs float64 ranking, or
    entries that underflow in fp32)."""
    if got == want:
        return
    assert len(got) == len(want), (got, want)
    floor = float(row.max()) * 1e-30
    g, w = sorted(float(row[j]) for j in got), sorted(float(row[j]) for j in want)
    for x, y in zip(g, w, strict=True):
        assert abs(x - y) <= 1e-3 * max(x, y) or max(x, y) <= floor, (got, want, g, w)


def block_counts(n: int, b: int) -> torch.Tensor:
    return torch.tensor([min(b, n - i * b) for i in range(-(-n // b))], dtype=torch.float64)


def rows_of(sel_indices: torch.Tensor) -> list[list[int]]:
    return [[int(x) for x in row if x != SENTINEL] for row in sel_indices]


# ---- 1. block scores ---------------------------------------------------------------------------

def _select_layers(m, layers, qk, states, seq_state, t, n0, prefill):
    """One call per layer at position t (the prefill of n0 tokens, or a decode step): selections and the walk
    rows the call left in ``seq_state``."""
    sels, rows = [], []
    for layer in layers:
        q, k = qk[layer]
        kv = k[:, : t + 1]
        if prefill:
            sels.append(m.select_prefill(SeqContext(layer, 0, 0, n0, states[layer], seq_state), q[:n0], kv, kv))
        else:
            sels.append(m.select_decode(SeqContext(layer, 0, t, t + 1, states[layer], seq_state), q[t], kv, kv))
        rows.append(seq_state["walk"][1])
    return sels, rows

def test_block_scores_match_brute_force_with_partial_last_block():
    b = 8
    n = rand_int(3 * b + 1, 7 * b)
    n += 3 if n % b == 0 else 0  # a partial last block
    cfg = model_cfg(head_dim=24)  # not a power of two: the SRHT pads to 32
    m = method(cfg)
    q, k = random_qk(n, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, b)
    st: dict = {}
    m.select_prefill(SeqContext(1, 0, 0, n, st, {}), q, k, k)
    qt, kt, a = brute_scores(q, k, explicit_srht(m.srht), b)
    cnt = block_counts(n, b)[:, None]
    torch.testing.assert_close(st["qs"].double() / cnt, qt, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st["ks"].double() / cnt, kt, rtol=1e-5, atol=1e-5)
    assert st["a_hat"].dtype == torch.bfloat16 and st["n"] == n
    torch.testing.assert_close(st["a_hat"].double(), a, **BF16)
    assert (st["a_hat"].triu(1) == 0).all()


# ---- 2. fast WHT and SRHT ----------------------------------------------------------------------
@pytest.mark.parametrize("d", [1, 2, 8, 32, 128])
def test_fwht_equals_explicit_hadamard_matrix(d):
    x = torch.randn(3, 5, d, dtype=torch.float64)
    torch.testing.assert_close(fwht(x), x @ hadamard(d) / math.sqrt(d))
    with pytest.raises(ValueError):
        fwht(torch.randn(4, 12))


@pytest.mark.parametrize("dim,r", [(24, 8), (64, 16), (16, 64)])
def test_srht_matrix_matches_explicit_construction(dim, r):
    s = SRHT(dim, r, rand_int(0, 2**62))
    assert s.sketch_dim == min(r, s.padded) and s.padded >= dim and s.padded & (s.padded - 1) == 0
    h = explicit_srht(s)
    torch.testing.assert_close(s.matrix().double(), h, rtol=1e-5, atol=1e-6)
    x = torch.randn(7, dim)
    torch.testing.assert_close(s.apply(x).double(), x.double() @ h, rtol=1e-5, atol=1e-5)


def test_srht_preserves_inner_products_in_expectation():
    dim, r, draws = 24, 8, 4000
    xy = torch.randn(2, dim)
    exact = float(xy[0].double() @ xy[1].double())
    base = rand_int(0, 2**40)
    est = torch.empty(draws, dtype=torch.float64)
    for i in range(draws):
        sk = SRHT(dim, r, base + i).apply(xy).double()
        est[i] = sk[0] @ sk[1]
    mean, se = float(est.mean()), float(est.std()) / math.sqrt(draws)
    assert se > 0  # r < d': a real subsample, not a rotation
    assert abs(mean - exact) < 5 * se + 1e-6, (mean, exact, se)
    # With r >= d' the sketch is a rotation: inner products are exact for every draw.
    full = SRHT(dim, 64, base).apply(xy).double()
    assert abs(float(full[0] @ full[1]) - exact) < 1e-4 * (1 + abs(exact))


def test_srht_is_fixed_per_model_and_seed():
    seed = rand_int(0, 2**31)
    a, b = method(model_cfg(), seed=seed), method(model_cfg(), seed=seed)
    torch.testing.assert_close(a.srht.matrix(), b.srht.matrix())
    x = torch.randn(4, 24)
    torch.testing.assert_close(a.srht.apply(x), a.srht.apply(x))  # not re-drawn per call
    assert not torch.equal(a.srht.matrix(), method(model_cfg(), seed=seed + 1).srht.matrix())
    assert derive_seed(seed, 64) != derive_seed(seed, 128)


# ---- 3. the walk in prefill --------------------------------------------------------------------
@pytest.mark.parametrize("walk,local", [("rollout", 1), ("product", 1), ("one-hop", 1), ("rollout", 3)])
def test_prefill_walk_selection_matches_brute_force_over_three_layers(walk, local):
    b, density = 8, 0.375  # exact in binary: Python and torch round the budgets identically
    n = rand_int(6 * b + 1, 10 * b)
    cfg = model_cfg(layers=4)
    alpha = 0.25 * rand_int(0, 3)
    m = method(cfg, density=density, walk=walk, residual=alpha, local_blocks=local, token_query="never")
    h_mat = explicit_srht(m.srht)
    seq_state: dict = {}
    stored, walks, sels = [], [], []
    for layer in (1, 2, 3):
        q, k = random_qk(n, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, b)
        st: dict = {}
        sel = m.select_prefill(SeqContext(layer, 0, 0, n, st, seq_state), q, k, k)
        torch.testing.assert_close(st["a_hat"].double(), brute_scores(q, k, h_mat, b)[2], **BF16)
        # The walk oracle reads the stored bf16 scores, as the method does (their values are checked above).
        stored.append(st["a_hat"].double())
        walks.append(seq_state["walk"][1].clone())
        sels.append(sel)
    for rw, sel, ref in zip(walks, sels, brute_walk(stored, 8.0, walk, alpha), strict=True):
        torch.testing.assert_close(rw.double(), ref, rtol=2e-3, atol=1e-30)
        assert sel.block_size == b and sel.indices.shape[0] == cfg.num_kv_heads
        assert (sel.indices == sel.indices[:1]).all()  # one selection shared by every KV head
        for qi, got in enumerate(rows_of(sel.indices[0])):
            assert_same_choice(got, brute_select(ref[qi], qi, density, local), ref[qi])


# ---- 4. decode's incremental state ---------------------------------------------------------------
def test_decode_incremental_updates_equal_recompute_from_scratch():
    b, density = 8, 0.375
    n0 = rand_int(2 * b + 1, 3 * b - 1)  # the prompt ends inside a block
    total = n0 + 2 * b + 3  # decode crosses two block boundaries
    cfg = model_cfg(layers=4)
    m = method(cfg, density=density, walk="rollout", token_query="never")  # block-mean rows, as prefill
    h_mat = explicit_srht(m.srht)
    layers = (1, 2, 3)
    qk = {layer: random_qk(total, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, b) for layer in layers}
    states: dict = {layer: {} for layer in layers}
    seq_state: dict = {}
    for layer in layers:
        q, k = qk[layer]
        m.select_prefill(SeqContext(layer, 0, 0, n0, states[layer], seq_state), q[:n0], k[:, :n0], k[:, :n0])
    for t in range(n0, total):
        nb = t // b + 1
        sels, rows = [], []
        for layer in layers:
            q, k = qk[layer]
            kv = k[:, : t + 1]
            sels.append(m.select_decode(SeqContext(layer, 0, t, t + 1, states[layer], seq_state), q[t], kv, kv))
            rows.append(seq_state["walk"][1])
        if t not in (n0, total - 1) and t % b > 1:
            continue  # check the first and last steps and both sides of every block boundary
        # From scratch on the full t + 1 tokens: block means, every row and column of A_hat, the R row.
        cnt = block_counts(t + 1, b)[:, None]
        for layer in layers:
            st = states[layer]
            qt, kt, a = brute_scores(qk[layer][0][: t + 1], qk[layer][1][:, : t + 1], h_mat, b)
            assert st["n"] == t + 1 and st["a_hat"].shape == (nb, nb)
            torch.testing.assert_close(st["qs"].double() / cnt, qt, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(st["ks"].double() / cnt, kt, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(st["a_hat"].double(), a, **BF16)
        walks = brute_walk([states[layer]["a_hat"].double() for layer in layers], 8.0)
        for row, sel, ref in zip(rows, sels, walks, strict=True):
            assert row.shape == (1, nb)
            torch.testing.assert_close(row[0].double(), ref[nb - 1], rtol=2e-3, atol=1e-30)
            assert sel.block_size == b and (sel.indices == sel.indices[:1]).all()
            got = rows_of(sel.indices)[0]
            assert_same_choice(got, brute_select(ref[nb - 1], nb - 1, density, prefill=False), ref[nb - 1])
    # Decode state equals a fresh prefill of the whole sequence through the method itself.
    fresh, fresh_seq = method(cfg, density=density, seed=m.config.seed), {}
    for layer in layers:
        q, k = qk[layer]
        st: dict = {}
        fresh.select_prefill(SeqContext(layer, 0, 0, total, st, fresh_seq), q, k, k)
        torch.testing.assert_close(st["qs"], states[layer]["qs"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(st["a_hat"].double(), states[layer]["a_hat"].double(), **BF16)


# ---- 4b. the token's own query row, and per-KV-head sketches ----------------------------------------
@pytest.mark.parametrize("token_query,heads,walk", [("decode", "mean", "rollout"), ("last", "mean", "one-hop"),
                                                    ("decode", "kv", "one-hop"), ("last", "kv", "rollout"),
                                                    ("never", "kv", "product")])
def test_token_rows_and_kv_heads_match_brute_force(token_query, heads, walk, monkeypatch):
    """Prefill then decode across a block boundary: the state stays the block means (per KV head with
    heads="kv"), the last row the walk reads is the last token's query against the key blocks where
    ``token_query`` says so, and the walk and selection follow, per score head."""
    b, density = 8, 0.375
    n0 = rand_int(3 * b + 1, 4 * b - 1)
    total = n0 + b + 1
    cfg = model_cfg(layers=4)
    m = method(cfg, density=density, token_query=token_query, heads=heads, walk=walk)
    h_mat = explicit_srht(m.srht)
    layers = (1, 2, 3)
    score_heads = list(range(cfg.num_kv_heads)) if heads == "kv" else [None]
    qk = {layer: random_qk(total, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, b) for layer in layers}
    states: dict = {layer: {} for layer in layers}
    seq_state: dict = {}
    seen: dict = {}
    def spy(method, ctx, qb0, nb, token_row=None):
        seen[ctx.layer] = token_row
        return walk_rows(method, ctx, qb0, nb, token_row)

    monkeypatch.setattr(sketch_walk_reference, "walk_rows", spy)
    for t in [n0 - 1, *range(n0, total)]:
        prefill = t == n0 - 1
        sels, rows = _select_layers(m, layers, qk, states, seq_state, t, n0, prefill)
        token = token_query == "last" or (token_query == "decode" and not prefill)
        nb = t // b + 1
        cnt = block_counts(t + 1, b)[:, None]
        scores: dict = {h: [] for h in score_heads}
        for layer in layers:
            st, (q, k) = states[layer], qk[layer]
            assert st["n"] == t + 1 and (seen[layer] is not None) == token
            for i, h in enumerate(score_heads):
                qt, kt, a = brute_scores(q[: t + 1], k[:, : t + 1], h_mat, b, h)
                got_qs = st["qs"] if h is None else st["qs"][:, h]
                got_a = st["a_hat"] if h is None else st["a_hat"][h]
                torch.testing.assert_close(got_qs.double() / cnt, qt, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(got_a.double(), a, **BF16)
                a = got_a.double().clone()  # the walk oracle reads the method's bf16 scores (checked above)
                if token:
                    want = head_query(q[t], cfg.num_kv_heads, h) @ h_mat @ kt.T / math.sqrt(h_mat.shape[1])
                    torch.testing.assert_close(seen[layer][i, 0].double(), want, **BF16)
                    a[nb - 1] = seen[layer][i, 0].double()
                scores[h].append(a)
        for i, h in enumerate(score_heads):
            for row, sel, ref in zip(rows, sels, brute_walk(scores[h], 8.0, walk), strict=True):
                got = (row if h is None else row[i]).double()
                want = ref if prefill else ref[nb - 1:]
                torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-30)
                idx = sel.indices[0 if h is None else h]
                assert sel.indices.shape[0] == cfg.num_kv_heads
                picked = rows_of(idx) if prefill else [rows_of(idx[None])[0]]
                for j, chosen in enumerate(picked):
                    qi = j if prefill else nb - 1
                    assert_same_choice(chosen, brute_select(ref[qi], qi, density, prefill=prefill), ref[qi])


# ---- 4c. paired heads and key parts ---------------------------------------------------------------
def brute_part_scores(q: torch.Tensor, k: torch.Tensor, H: torch.Tensor, b: int, parts: int, heads: str):
    """Explicit loops (float64) for ``heads`` in mean / kv / pair / pair-lse with ``parts`` key parts per
    block: per score head (the head mean, or each KV head with its query group) the sketched query block
    means [nb, S, r] and key part means [nb * parts, S, r] (empty parts 0), and A_hat with the last row
    also scored by the last token's query: a block scores its best non-empty part, then the KV heads'
    scores combine by mean (pair) or log-sum-exp (pair-lse): [S', nb, nb] (S' = h_kv for kv, else 1),
    and the token row [S', nb]."""
    n, r, h_kv = q.shape[0], H.shape[1], k.shape[0]
    nb, sub = -(-n // b), b // parts
    score_heads = [None] if heads == "mean" else list(range(h_kv))
    qt = torch.zeros(nb, len(score_heads), r, dtype=torch.float64)
    kt = torch.zeros(nb * parts, len(score_heads), r, dtype=torch.float64)
    for x, h in enumerate(score_heads):
        for i in range(nb):
            lo, hi = i * b, min(n, (i + 1) * b)
            qt[i, x] = sum(head_query(q[t], h_kv, h) for t in range(lo, hi)) / (hi - lo) @ H
        for j in range(nb * parts):
            lo, hi = j * sub, min(n, (j + 1) * sub)
            if lo < n:
                kt[j, x] = sum(k[:, t].double().mean(0) if h is None else k[h, t].double()
                               for t in range(lo, hi)) / (hi - lo) @ H

    def row(qvec: torch.Tensor, last: int) -> torch.Tensor:
        out = torch.zeros(len(score_heads), nb, dtype=torch.float64)
        for x in range(len(score_heads)):
            for j in range(last + 1):
                out[x, j] = max(float(qvec[x] @ kt[j * parts + p, x]) / math.sqrt(r)
                                for p in range(parts) if (j * parts + p) * sub < n)
        return out

    a = torch.zeros(len(score_heads), nb, nb, dtype=torch.float64)
    for i in range(nb):
        a[:, i] = row(qt[i], i)
    tok = row(torch.stack([head_query(q[n - 1], h_kv, h) @ H for h in score_heads]), nb - 1)
    if heads == "pair":
        a, tok = a.mean(0, keepdim=True), tok.mean(0, keepdim=True)
    elif heads == "pair-lse":
        a, tok = a.logsumexp(0, keepdim=True), tok.logsumexp(0, keepdim=True)
    return qt, kt, a.tril(), tok


def part_counts(n: int, b: int, parts: int) -> torch.Tensor:
    sub = b // parts
    return torch.tensor([max(1, min(sub, n - j * sub)) for j in range(-(-n // b) * parts)], dtype=torch.float64)


@pytest.mark.parametrize("heads,parts,token_query,walk", [
    ("pair", 1, "last", "one-hop"), ("pair-lse", 4, "last", "one-hop"), ("pair", 2, "decode", "rollout"),
    ("pair-lse", 1, "never", "product"), ("mean", 4, "last", "one-hop"), ("kv", 2, "decode", "one-hop")])
def test_paired_heads_and_key_parts_match_brute_force(heads, parts, token_query, walk):
    """Prefill then decode across a block boundary: sketches, A_hat (with its token row), walk and one
    selection per layer equal explicit loops, against a from-scratch oracle at every step."""
    b, density = 8, 0.375
    n0 = rand_int(3 * b + 1, 4 * b - 1)
    total = n0 + b + 1
    cfg = model_cfg(layers=4)
    m = method(cfg, density=density, token_query=token_query, heads=heads, walk=walk, sub_blocks=parts)
    h_mat = explicit_srht(m.srht)
    layers = (1, 2, 3)
    qk = {layer: random_qk(total, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, b) for layer in layers}
    states: dict = {layer: {} for layer in layers}
    seq_state: dict = {}
    for t in [n0 - 1, *range(n0, total)]:
        prefill = t == n0 - 1
        sels, rows = _select_layers(m, layers, qk, states, seq_state, t, n0, prefill)
        token = token_query == "last" or (token_query == "decode" and not prefill)
        nb = t // b + 1
        walked = []
        for layer in layers:
            st, (q, k) = states[layer], qk[layer]
            qt, kt, a, tok = brute_part_scores(q[: t + 1], k[:, : t + 1], h_mat, b, parts, heads)
            s = qt.shape[1]
            assert st["n"] == t + 1 and st["ks"].shape[0] == nb * parts
            torch.testing.assert_close(st["qs"].double().view(nb, s, -1) / block_counts(t + 1, b)[:, None, None], qt,
                                       rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(st["ks"].double().view(-1, s, kt.shape[-1])
                                       / part_counts(t + 1, b, parts)[:, None, None], kt, rtol=1e-5, atol=1e-5)
            got_a = st["a_hat"].double().view(-1, nb, nb)
            torch.testing.assert_close(got_a, a, **BF16)
            a = got_a.clone()  # the walk oracle reads the method's bf16 scores (checked above)
            if token:
                a[:, nb - 1] = tok.to(torch.bfloat16).double()
            walked.append(a)
        for i in range(walked[0].shape[0]):
            for row, sel, ref in zip(rows, sels, brute_walk([w[i] for w in walked], 8.0, walk), strict=True):
                got = (row[i] if heads == "kv" else row).double()
                torch.testing.assert_close(got, ref if prefill else ref[nb - 1:], rtol=2e-3, atol=1e-30)
                assert sel.indices.shape[0] == cfg.num_kv_heads
                if heads != "kv":
                    assert (sel.indices == sel.indices[:1]).all()  # one selection shared by every KV head
                idx = sel.indices[i]
                for j, chosen in enumerate(rows_of(idx) if prefill else [rows_of(idx[None])[0]]):
                    qi = j if prefill else nb - 1
                    assert_same_choice(chosen, brute_select(ref[qi], qi, density, prefill=prefill), ref[qi])


@pytest.mark.parametrize("heads,unit", [("pair", "block"), ("pair-lse", "block"), ("pair-lse", "part")])
def test_paired_heads_under_tensor_parallelism_match_one_device(heads, unit):
    """Two shards of one KV head each: one SUM all-reduce of the score rows per call gives both the
    one-device A_hat, walk and selection (prefill, then decode steps)."""
    b = 8
    cfg = model_cfg(layers=3, heads=4, kv_heads=2)
    kw = {"seed": rand_int(0, 2**31), "heads": heads, "sub_blocks": 2, "density": 0.375, "decode_unit": unit}
    one, shards = method(cfg, **kw), [method(cfg, **kw), method(cfg, **kw)]
    n0 = rand_int(3 * b + 1, 5 * b)
    q, k = random_qk(n0 + 3, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, b)
    sent: list[list[torch.Tensor]] = [[], []]

    def reducer(rank: int):
        # Pass 1 of each call records the local partial; the reduce returns it plus the peer's (pass 2).
        def reduce(x: torch.Tensor) -> torch.Tensor:
            sent[rank].append(x)
            return x + peer[rank].pop(0) if peer[rank] else x
        return reduce

    peer: list[list[torch.Tensor]] = [[], []]
    for rank, sh in enumerate(shards):
        sh.head_reduce = reducer(rank)

    def run(backend, qs, ks, st, ss):
        out = [backend.select_prefill(SeqContext(1, 0, 0, n0, st, ss), qs[:n0], ks[:, :n0], ks[:, :n0]).indices]
        for t in range(n0, n0 + 3):
            kv = ks[:, : t + 1]
            out.append(backend.select_decode(SeqContext(1, 0, t, t + 1, st, ss), qs[t], kv, kv).indices)
        return out

    st_one: dict = {}
    want = run(one, q, k, st_one, {})
    parts = [(q[:, 2 * r: 2 * r + 2], k[r: r + 1]) for r in range(2)]
    for rank in range(2):  # pass 1: every shard's partials
        run(shards[rank], *parts[rank], {}, {})
    peer[0], peer[1] = sent[1][:], sent[0][:]
    for rank in range(2):  # pass 2: each call reduced with the peer's partial of the same call
        st: dict = {}
        got = run(shards[rank], *parts[rank], st, {})
        torch.testing.assert_close(st["a_hat"].double(), st_one["a_hat"].double(), **BF16)
        for g, w in zip(got, want, strict=True):
            assert g.shape[0] == 1 and torch.equal(g[0], w[0])


def brute_part_row(q_t: torch.Tensor, k: torch.Tensor, H: torch.Tensor, b: int, parts: int, heads: str):
    """The token's scores per key part (float64 loops; parts past the last token -inf), the heads combined
    as in ``brute_part_scores``: [S', nb * parts]."""
    n, r, h_kv = k.shape[1], H.shape[1], k.shape[0]
    sub = b // parts
    score_heads = [None] if heads == "mean" else list(range(h_kv))
    out = torch.full((len(score_heads), -(-n // b) * parts), -math.inf, dtype=torch.float64)
    for x, h in enumerate(score_heads):
        qv = head_query(q_t, h_kv, h) @ H
        for j in range(-(-n // sub)):
            ts = range(j * sub, min(n, (j + 1) * sub))
            kbar = sum(k[:, t].double().mean(0) if h is None else k[h, t].double() for t in ts) / len(ts)
            out[x, j] = float(qv @ (kbar @ H)) / math.sqrt(r)
    if heads == "pair":
        return out.mean(0, keepdim=True)
    return out.logsumexp(0, keepdim=True) if heads == "pair-lse" else out


@pytest.mark.parametrize("heads,parts,local", [("pair-lse", 4, 1), ("pair", 2, 2), ("mean", 4, 1), ("kv", 2, 1)])
def test_part_decode_selects_top_parts_by_brute_force(heads, parts, local):
    """decode_unit="part": the sink's and local blocks' parts plus the top parts by the token's part scores,
    tau * parts in all; causal, deduplicated, in units of B / parts tokens."""
    b, density = 8, 0.375
    n0 = rand_int(4 * b + 1, 6 * b - 1)
    cfg = model_cfg(layers=3)
    m = method(cfg, density=density, heads=heads, sub_blocks=parts, decode_unit="part", local_blocks=local)
    h_mat = explicit_srht(m.srht)
    qk = {layer: random_qk(n0 + b + 1, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, b) for layer in (1, 2)}
    states: dict = {1: {}, 2: {}}
    seq_state: dict = {}
    for layer, (q, k) in qk.items():
        m.select_prefill(SeqContext(layer, 0, 0, n0, states[layer], seq_state), q[:n0], k[:, :n0], k[:, :n0])
    sub = b // parts
    for t in range(n0, n0 + b + 1):
        nb = t // b + 1
        for layer, (q, k) in qk.items():
            kv = k[:, : t + 1]
            sel = m.select_decode(SeqContext(layer, 0, t, t + 1, states[layer], seq_state), q[t], kv, kv)
            assert sel.block_size == sub and sel.indices.shape[0] == cfg.num_kv_heads and "part_row" not in seq_state
            want_rows = brute_part_row(q[t], kv, h_mat, b, parts, heads)
            held = [j for j in range(nb * parts) if j * sub <= t]
            forced = sorted(j for j in held if j // parts == 0 or j // parts > nb - 1 - local)
            budget = max(1, round(density * nb)) * parts
            for x, row in enumerate(want_rows):
                rest = sorted(set(held) - set(forced), key=lambda j: (-float(row[j]), j))
                want = sorted(set(forced) | set(rest[: max(0, budget - len(forced))]))
                got = rows_of(sel.indices[x if heads == "kv" else 0][None])[0]
                assert got == sorted(set(got)) and all(j in held for j in got)
                assert_same_choice(got, want, row)
            if heads != "kv":
                assert (sel.indices == sel.indices[:1]).all()


def test_head_mean_key_parts_keep_the_eager_decode():
    """The head-mean batched decode scores whole key blocks: with key parts it is not built, while whole blocks
    and the paired scorings (whose state keeps the parts) get theirs."""
    cfg = model_cfg()
    cache = KVCache(cfg, 8, 8)
    mean_parts = method(cfg, sub_blocks=2)
    assert not mean_parts.build_batched(cache, 4) and not mean_parts.batched_decode
    assert method(cfg).build_batched(cache, 4)
    paired = method(cfg, heads="pair-lse", sub_blocks=2, decode_unit="part", walk="one-hop", token_query="last")
    assert paired.build_batched(cache, None)  # page-indexed: no slots to size
    assert not method(cfg).build_batched(cache, None)  # head mean: its slots are sized by the graph runner


# ---- 5. selection invariants, chunked prefill, density -------------------------------------------
@pytest.mark.parametrize("density", [0.05, 0.2, 0.5, 1.0])
@pytest.mark.parametrize("scoring", [{}, {"heads": "pair-lse", "sub_blocks": 4}, {"heads": "pair", "sub_blocks": 2}])
def test_selections_are_causal_deduplicated_with_sink_and_diagonal(density, scoring):
    b = 8
    cfg = model_cfg(layers=3)
    m = method(cfg, density=density, **scoring)
    n = rand_int(b + 1, 12 * b)
    seq_state: dict = {}
    states: dict = {1: {}, 2: {}}
    qk = {layer: random_qk(n + 5, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, b) for layer in states}

    def check_row(row: list[int], qi: int, prefill: bool = True) -> None:
        assert row == sorted(set(row)), row  # ascending and deduplicated
        assert row[0] == 0 and row[-1] == qi and all(0 <= j <= qi for j in row)  # sink, diagonal, causal
        budget = prefill_block_budgets(density, qi + 1, 2, b)[qi] if prefill else round(density * (qi + 1))
        assert len(row) == max(max(1, budget), 1 if qi == 0 else 2)

    for layer in states:
        q, k = qk[layer]
        sel = m.select_prefill(SeqContext(layer, 0, 0, n, states[layer], seq_state), q[:n], k[:, :n], k[:, :n])
        assert sel.indices.dtype == torch.int32 and sel.indices.shape[:2] == (cfg.num_kv_heads, -(-n // b))
        for qi, row in enumerate(rows_of(sel.indices[0])):
            check_row(row, qi)
    for t in range(n, n + 5):
        for layer in states:
            q, k = qk[layer]
            kv = k[:, : t + 1]
            sel = m.select_decode(SeqContext(layer, 0, t, t + 1, states[layer], seq_state), q[t], kv, kv)
            assert sel.indices.shape[0] == cfg.num_kv_heads and sel.block_size == b
            check_row(rows_of(sel.indices)[0], t // b, prefill=False)


@pytest.mark.parametrize("heads", ["pair-lse", "pair"])
def test_decode_query_heads_scores_parts_by_every_query_head(heads):
    """``decode_query="heads"``: a decode step's part row is each query head's sketched score of each part's
    mean key sketch, combined over every query head (log-sum-exp or mean), against explicit loops."""
    b, parts = 8, 4
    cfg = model_cfg(layers=2)  # 4 query heads, 2 KV heads: groups of 2
    m = method(cfg, density=0.5, heads=heads, sub_blocks=parts, decode_unit="part", decode_query="heads")
    n = rand_int(3 * b, 8 * b)
    q, k = random_qk(n + 1, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, b)
    st, ss = {}, {}
    m.select_prefill(SeqContext(1, 0, 0, n, st, ss), q[:n], k[:, :n], k[:, :n])
    m._update_sketch(SeqContext(1, 0, n, n + 1, st, ss), q[n: n + 1], k[:, n: n + 1])
    got = ss["part_row"][0, 0].double()
    H = m.srht.matrix().double()  # d x r
    size, r = b // parts, H.shape[1]
    held = -(-(n + 1) // size)
    g = cfg.num_heads // cfg.num_kv_heads
    want = []
    for j in range(held):
        keys = k[:, j * size: min(n + 1, (j + 1) * size)].double()
        total = 0.0
        for h in range(cfg.num_heads):
            s = float((q[n, h].double() @ H) @ (keys[h // g].mean(0) @ H)) / math.sqrt(r)
            total += math.exp(s) if heads == "pair-lse" else s / cfg.num_heads
        want.append(math.log(total) if heads == "pair-lse" else total)
    # parts of the block with no token yet: -inf ("pair"), fp64's floor ("pair-lse": log of the clamped sum)
    assert (got[held:] <= math.log(torch.finfo(torch.float64).tiny) + 1e-6).all()
    torch.testing.assert_close(got[:held], torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=1e-4)


def test_chunked_prefill_continues_the_sketches():
    b = 8
    cfg = model_cfg(layers=3)
    m = method(cfg, density=0.375, walk="rollout")
    n = rand_int(5 * b, 8 * b)
    cut = rand_int(b + 1, n - b)  # usually inside a block
    qk = {layer: random_qk(n, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, b) for layer in (1, 2)}
    one: dict = {1: {}, 2: {}}
    two: dict = {1: {}, 2: {}}
    ss_one: dict = {}
    ss_two: dict = {}
    for layer in (1, 2):
        q, k = qk[layer]
        full = m.select_prefill(SeqContext(layer, 0, 0, n, one[layer], ss_one), q, k, k)
        m.select_prefill(SeqContext(layer, 0, 0, cut, two[layer], ss_two), q[:cut], k[:, :cut], k[:, :cut])
    for layer in (1, 2):
        q, k = qk[layer]
        part = m.select_prefill(SeqContext(layer, 0, cut, n, two[layer], ss_two), q[cut:], k, k)
        torch.testing.assert_close(two[layer]["qs"], one[layer]["qs"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(two[layer]["a_hat"].double(), one[layer]["a_hat"].double(), **BF16)
    qb0 = cut // b
    ref = ss_one["walk"][1][qb0:]
    torch.testing.assert_close(ss_two["walk"][1], ref, rtol=2e-3, atol=1e-30)
    full_rows = rows_of(full.indices[0])[qb0:]
    for i, (got, want) in enumerate(zip(rows_of(part.indices[0]), full_rows, strict=True)):
        assert_same_choice(got, want, ref[i].double())
    # A prefix this backend never sketched cannot be walked.
    with pytest.raises(NotImplementedError):
        q, k = qk[1]
        method(cfg).select_prefill(SeqContext(1, 0, cut, n, {}, {}), q[cut:], k, k)


def test_tensor_parallel_head_reduce_matches_one_device():
    """Two shards holding half the heads each, summed by ``head_reduce``, select what one device does."""
    b = 8
    cfg = model_cfg(layers=3, heads=4, kv_heads=2)
    seed = rand_int(0, 2**31)
    one, shard = method(cfg, seed=seed), method(cfg, seed=seed)
    n = rand_int(4 * b, 8 * b)
    q, k = random_qk(n, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, b)
    q, k = torch.cat([q[:, :2], q[:, :2]], 1), torch.cat([k[:1], k[:1]], 0)  # the shards hold equal halves
    shard.head_reduce = lambda x: x * 2  # what a SUM all-reduce over the two equal shards returns
    st_one, st_shard = {}, {}
    a = one.select_prefill(SeqContext(1, 0, 0, n, st_one, {}), q, k, k)
    s = shard.select_prefill(SeqContext(1, 0, 0, n, st_shard, {}), q[:, :2], k[:1], k[:1])
    torch.testing.assert_close(st_shard["qs"], st_one["qs"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(st_shard["a_hat"].double(), st_one["a_hat"].double(), **BF16)
    assert s.indices.shape[0] == 1 and a.indices.shape[0] == 2


def test_config_validation_and_registry():
    with pytest.raises(ValueError):
        SketchWalkConfig(sketch_dim=0)
    with pytest.raises(ValueError):
        SketchWalkConfig(exponent=0.0)
    with pytest.raises(ValueError):
        SketchWalkConfig(density=0.0)
    with pytest.raises(ValueError):
        SketchWalkConfig(block_size=48)
    for bad in ({"walk": "random"}, {"residual": 1.0}, {"residual": -0.1}, {"local_blocks": 0},
                {"token_query": "all"}, {"heads": "q"}, {"sub_blocks": 0}, {"sub_blocks": 3}, {"sub_blocks": True},
                {"decode_unit": "token"}, {"decode_unit": "part", "walk": "rollout"}, {"decode_query": "all"},
                {"decode_query": "heads", "decode_unit": "block"}, {"decode_query": "heads", "heads": "kv"}):
        with pytest.raises(ValueError):
            SketchWalkConfig(**bad)
    c = SketchWalkConfig()
    assert (c.block_size, c.sketch_dim, c.exponent, c.density, c.dense_layers) == (64, 64, 8.0, 0.2, (0, 1))
    assert (c.walk, c.residual, c.local_blocks, c.token_query, c.heads) == ("one-hop", 0.5, 1, "last", "pair-lse")
    assert (c.sub_blocks, c.decode_unit, c.decode_query) == (8, "part", "group")
    from raysparse.methods.registry import get_method

    # --density is the whole model's: 0.75 over 4 layers, 2 of them dense, is 0.5 at each sparse layer
    backend = get_method("sketch_walk").factory(model_cfg(), density=0.75, sketch_dim=32, dense_layers=[0, 1])
    assert isinstance(backend, SketchWalk) and backend.config.target_density == 0.75
    assert backend.config.density == backend.layer_density == 0.5
    with pytest.raises(ValueError, match="dense layers alone attend: 2 of 4 layers"):
        get_method("sketch_walk").factory(model_cfg(), density=0.5, dense_layers=[0, 1])  # they alone attend 0.5
    # by default the registry spreads it over every layer
    assert get_method("sketch_walk").factory(model_cfg(), density=0.5).layer_density == 0.5
    assert get_method("sketch_walk").factory(model_cfg(), density=0.5, dense_layers=(0,)).layer_density == \
        pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        get_method("sketch_walk").factory(model_cfg(), bogus=1)


@pytest.fixture(scope="module")
def tiny_model():
    hf_cfg = tiny_hf_config(layers=3)
    return model_from_state(hf_cfg, random_state(hf_cfg, seed=rand_int(0, 10_000)).state_dict())


def run_steps(model, backend, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """A ragged prefill then greedy decode steps; the logits of every step."""
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
    return out


@pytest.mark.parametrize("scoring", [GRAPH_DECODE, {}, {"heads": "pair", "sub_blocks": 4}])
def test_density_one_reproduces_dense_attention_through_the_model(tiny_model, scoring):
    cfg = tiny_model.cfg
    # Ragged prompts that end inside a block, so decode crosses a block boundary.
    prompts = [torch.randint(0, cfg.vocab_size, (16 * rand_int(2, 5) - rand_int(1, 8),)).tolist() for _ in range(2)]
    sw = SketchWalk(cfg, SketchWalkConfig(density=1.0, dense_layers=(), block_size=16, sketch_dim=16, **scoring))
    got = run_steps(tiny_model, sw, prompts, 10)
    want = run_steps(tiny_model, DenseAttention(cfg.num_layers), prompts, 10)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    assert sw.meter.overall() == pytest.approx(1.0)
    # Through the Generator too: greedy tokens identical to dense.
    reqs = [GenerationRequest(tuple(p), SamplingParams(10, ignore_eos=True), str(i)) for i, p in enumerate(prompts)]

    def tokens(backend) -> dict[str, tuple[int, ...]]:
        gen = Generator(tiny_model, fresh_cache(tiny_model, 1024, page_size=16), backend)
        return {ev.request_id: ev.token_ids for ev in gen.generate(reqs) if hasattr(ev, "finish_reason")}

    sw2 = SketchWalk(cfg, SketchWalkConfig(density=1.0, dense_layers=(), block_size=16, sketch_dim=16, **scoring))
    assert tokens(sw2) == tokens(DenseAttention(cfg.num_layers))
    assert not sw2._seq_state  # released with the sequences


def test_real_density_near_budget(tiny_model):
    cfg = tiny_model.cfg
    sw = SketchWalk(cfg, SketchWalkConfig(density=0.2, dense_layers=(0,), block_size=16, sketch_dim=16))
    prompts = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (448, rand_int(300, 440))]
    run_steps(tiny_model, sw, prompts[:1], 0)
    per_layer = sw.meter.per_layer()
    assert per_layer[0] == 1.0
    for d in per_layer[1:]:
        assert 0.17 < d < 0.25, per_layer
    sw.meter.reset()
    run_steps(tiny_model, sw, prompts, 8)
    for d in sw.meter.per_layer()[1:]:
        assert 0.17 < d < 0.25, sw.meter.per_layer()


def test_shard_executor_binds_every_backend_it_creates():
    """The executor binds each new backend (and what it wraps) to the shard through ``AttentionBackend.bind``:
    Sketch&Walk takes the group's all-reduce as its walk coordinator under TP (inside Delta too) and none on
    one shard; a wrapped backend gets no graph runner, since it never decodes from a capture of its own."""
    import dataclasses

    from raysparse.attention import ShardContext
    from raysparse.shard_executor import ShardExecutor, bind_backend
    from raysparse.step_plan import method_key

    cfg = tiny_hf_config(layers=3)
    model = model_from_state(cfg, random_state(cfg, seed=5).state_dict())
    group = ShardExecutor(model, fresh_cache(model, 256), rank=0, world_size=2, reduce=lambda t: t)
    dens = {"density": 0.8}  # of the whole model: layers 0 and 1 of 3 are dense, so 0.4 at layer 2
    sw = group.backend(method_key("sketch_walk", dens))
    assert sw.head_reduce is not None and sw.batch_decoder is None  # pages of 16 are not blocks
    assert group.backend(method_key("delta", {"base": "sketch_walk", **dens})).base.head_reduce is not None
    assert ShardExecutor(model, fresh_cache(model, 256)).backend(method_key("sketch_walk", dens)).head_reduce is None

    seen: list[tuple[object, ShardContext]] = []

    class Recording(DenseAttention):
        wraps: tuple[DenseAttention, ...] = ()

        def bind(self, shard: ShardContext) -> None:
            seen.append((self, shard))

        def wrapped_backends(self) -> tuple[DenseAttention, ...]:
            return self.wraps

    outer, inner = Recording(1), Recording(1)
    outer.wraps = (inner,)
    ctx = ShardContext(max_batch=8, all_reduce=lambda t: t)
    bind_backend(outer, ctx)
    assert seen == [(outer, ctx), (inner, dataclasses.replace(ctx, max_batch=None))]
