"""Delta's fitted modes (far-merge, the default, and delta-shrunk) against a plain PyTorch reference, their
fallback, chunking, and the honest density of Delta's dense rows inside ``--density``."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import measure_density, random_state, tiny_hf_config
from test_baselines import ctx_for, model_cfg, rand_qkv

from raysparse.attention import dense_attention
from raysparse.loader import model_from_state
from raysparse.methods.delta import Delta
from raysparse.methods.delta_config import DeltaConfig, DeltaSelection
from raysparse.methods.registry import create_backend
from raysparse.methods.selection import mask_from_indices
from raysparse.methods.views import SeqContext

GAMMA, B = 16, 16
BASE = {"sink_tokens": 16, "window": 48}


def seeded() -> int:
    return int(torch.randint(0, 1 << 30, ()))


def delta(mode: str = "far-merge", **kw) -> Delta:
    kw.setdefault("tail", 0)
    kw.setdefault("base_params", BASE)
    return Delta(model_cfg(), DeltaConfig(block_size=B, gamma=GAMMA, mode=mode, **kw))


def reference(q, k, v, sel_indices, mode: str, check_every: int, alpha_fixed: float | None = None,
              tail_lo: int | None = None) -> torch.Tensor:
    """Delta's fitted modes written out row by row and head by head from their definition, for a whole prompt
    (q_start 0): the base's output and log-mass over its selected causal keys, each anchor's (row gamma j) far
    part (its causal keys outside the selection: output, log-mass and mean key under those weights), the
    prediction, the per-head alpha fitted on the check rows at or before each row, then the dense rows."""
    n, h, d = q.shape
    g = h // k.shape[0]
    scale = 1 / math.sqrt(d)
    nkb = -(-n // B)
    blocks = mask_from_indices(sel_indices, nkb)  # [h_kv, nqb, nkb]

    def attend(p, head, keys):  # keys: bool [n] -> out [d], lse, mean key
        if not keys.any():
            return torch.zeros(d), -math.inf, torch.zeros(d)
        s = (k[head // g, keys] @ q[p, head]) * scale
        w = torch.softmax(s, 0)
        return w @ v[head // g, keys], float(torch.logsumexp(s, 0)), w @ k[head // g, keys]

    def keysets(p, head):
        causal = torch.arange(n) <= p
        near = blocks[head // g, p // B].repeat_interleave(B)[:n] & causal
        return causal, near, causal & ~near

    o_s = torch.zeros(n, h, d)
    lse_s = torch.zeros(n, h)
    o_d = torch.zeros(n, h, d)
    for p in range(n):
        for head in range(h):
            causal, near, _ = keysets(p, head)
            o_s[p, head], lse_s[p, head], _ = attend(p, head, near)
            o_d[p, head] = attend(p, head, causal)[0]
    pred = torch.zeros(n, h, d)
    for p in range(n):
        a = (p // GAMMA) * GAMMA
        for head in range(h):
            if mode == "delta-shrunk":
                pred[p, head] = o_d[a, head] - o_s[a, head]
                continue
            o_f, lse_f, kbar = attend(a, head, keysets(a, head)[2])
            if lse_f == -math.inf:
                continue
            lse_hat = lse_f + scale * float((q[p, head] - q[a, head]) @ kbar)
            w = 1 / (1 + math.exp(float(lse_s[p, head]) - lse_hat))
            pred[p, head] = w * (o_f - o_s[p, head])
    checks = [p for p in range(n) if p % GAMMA == GAMMA // 2
              and (p // GAMMA < check_every or (p // GAMMA) % check_every == check_every - 1)]
    out = o_s.clone()
    for p in range(n):
        for head in range(h):
            if alpha_fixed is not None:
                alpha = alpha_fixed
            else:
                fit = [c for c in checks if c <= p and pred[c, head].norm() > 1e-5 * o_s[c, head].norm()]
                num = sum(float((o_d[c, head] - o_s[c, head]) @ pred[c, head]) for c in fit)
                den = sum(float(pred[c, head] @ pred[c, head]) for c in fit)
                alpha = min(1.0, max(0.0, num / den)) if den > 0 else 0.0
            out[p, head] = o_s[p, head] + alpha * pred[p, head]
    dense = [p for p in range(n) if p % GAMMA == 0 or (alpha_fixed is None and p in checks)
             or (tail_lo is not None and p >= tail_lo)]
    out[dense] = o_d[dense]
    return out


@pytest.mark.parametrize("mode", ["far-merge", "delta-shrunk"])
@pytest.mark.parametrize("check_every", [1, 3])
def test_fitted_modes_match_the_reference(mode, check_every):
    seed = seeded()
    n = 203
    q, k, v = rand_qkv(n, seed=seed)
    m = delta(mode, check_every=check_every)
    sel = m.base.select_prefill(ctx_for(n, n), q, k, v)
    out, _ = m.prefill_seq(ctx_for(n, n), q, k, v)
    ref = reference(q, k, v, sel.indices, mode, check_every)
    assert (out - ref).abs().max() < 1e-4, f"seed {seed}"
    assert (out - m.base.prefill_seq(ctx_for(n, n), q, k, v)[0]).abs().max() > 1e-3, f"seed {seed}"  # it corrects


def test_far_merge_with_a_fixed_alpha_and_a_dense_tail_matches_the_reference():
    seed = seeded()
    n = 230
    q, k, v = rand_qkv(n, seed=seed)
    m = delta(alpha=0.6, tail=40)
    sel = m.base.select_prefill(ctx_for(n, n), q, k, v)
    out, _ = m.prefill_seq(ctx_for(n, n), q, k, v)
    tail_lo = n - (n % GAMMA + 40)
    assert (out - reference(q, k, v, sel.indices, "far-merge", 1, 0.6, tail_lo)).abs().max() < 1e-4, f"seed {seed}"


@pytest.mark.parametrize("mode", ["far-merge", "delta-shrunk"])
@pytest.mark.parametrize("n,n_q", [(257, 257), (300, 121)])
def test_alpha_zero_is_recompute(mode, n, n_q):
    """alpha = 0 leaves the base's output with the dense rows swapped in: the recompute mode, pairs included."""
    seed = seeded()
    q, k, v = rand_qkv(n, n_q, seed=seed)
    out0, pairs0 = delta(mode, alpha=0.0, tail=128).prefill_seq(ctx_for(n, n_q), q, k, v)
    out_r, pairs_r = delta("recompute", tail=128).prefill_seq(ctx_for(n, n_q), q, k, v)
    assert (out0 - out_r).abs().max() < 1e-5 and pairs0 == pairs_r, f"seed {seed}"


@pytest.mark.parametrize("mode", ["far-merge", "delta-shrunk"])
def test_chunked_prefill_equals_whole(mode):
    """Anchors' far parts (or corrections) and the check rows' fit are carried in the sequence's state: a prompt
    in three chunks (cut inside a gamma-block, before and after a check row) gives the whole prompt's output and
    pairs."""
    seed = seeded()
    n, cuts = 331, (135, 220)  # 135: row 7 of block 8 (anchor 128 in the first chunk); 220: after check 216
    q, k, v = rand_qkv(n, seed=seed)
    whole, pairs = delta(mode, check_every=2).prefill_seq(ctx_for(n, n), q, k, v)
    m, state, seq_state, outs, total = delta(mode, check_every=2), {}, {}, [], 0.0
    for lo, hi in zip((0, *cuts), (*cuts, n), strict=True):
        o, p = m.prefill_seq(SeqContext(2, 0, lo, hi, state, seq_state), q[lo:hi], k[:, :hi], v[:, :hi])
        outs.append(o)
        total += p
    assert (torch.cat(outs) - whole).abs().max() < 1e-5, f"seed {seed}"
    assert total == pytest.approx(pairs), f"seed {seed}"


def test_a_correction_that_cannot_help_falls_back():
    """On i.i.d. random rows an anchor's difference O_dense - O_sparse says nothing of another row's: the fitted
    delta-shrunk scales it down (alpha near 0, heads falling back), and its fit over all check rows never raises
    their error above the base's; the stats say so per layer. The paper's formula, unscaled, raises it."""
    seed = seeded()
    n = 640
    q, k, v = rand_qkv(n, seed=seed)
    m = delta("delta-shrunk", check_every=1)
    m.prefill_seq(ctx_for(n, n), q, k, v)
    st = m.stats_dict()
    assert st["alpha_per_layer"][:2] == [None, None] and st["alpha_per_layer"][2] == st["alpha"]
    assert st["alpha"] < 0.3 and st["fallback_per_layer"][2] == st["fallback"], f"seed {seed} {st}"
    # In-sample: the final alpha, fitted over every check row, never raises their error.
    o_s = m.base.prefill_seq(ctx_for(n, n), q, k, v)[0]
    o_d = dense_attention(q, k, v)
    chk = torch.arange(GAMMA // 2, n, GAMMA)
    d_true, d_pred = (o_d - o_s)[chk], (o_d - o_s)[chk - GAMMA // 2]
    alpha = ((d_true * d_pred).sum((0, 2)) / (d_pred ** 2).sum((0, 2))).clamp(0, 1)
    after = (d_true - alpha[None, :, None] * d_pred).norm()
    assert after <= d_true.norm() + 1e-6 and (d_true - d_pred).norm() > d_true.norm(), f"seed {seed}"
    m.reset_stats()
    assert m.stats_dict()["alpha"] is None


def test_far_merge_reduces_the_error_of_its_base_where_neighbouring_queries_are_alike():
    """The far part of an anchor carries over to its block's other rows (same far keys under the block base),
    merged with each row's own sparse attention by the row's own estimated far mass: where a block's queries are
    alike (here each row's query is its block's plus noise), the output error of the rows not computed densely
    drops."""
    seed = seeded()
    n = 400
    q, k, v = rand_qkv(n, seed=seed)
    q = q[::GAMMA].repeat_interleave(GAMMA, 0)[:n] + 0.5 * q
    m = delta(check_every=1)
    seen = []
    m.tracer = lambda *a: seen.append(a[4])
    out, _ = m.prefill_seq(ctx_for(n, n), q, k, v)
    o_s = m.base.prefill_seq(ctx_for(n, n), q, k, v)[0]
    o_d = dense_attention(q, k, v)
    rows = ~seen[-1].dense_rows
    assert isinstance(seen[-1], DeltaSelection) and seen[-1].mode == "far-merge"
    assert (out - o_d)[rows].norm() < 0.8 * (o_s - o_d)[rows].norm(), f"seed {seed}"
    st = m.stats_dict()
    assert st["check_error_ratio"] < 1 and st["alpha"] > 0.5, f"seed {seed} {st}"


def test_reported_pairs_are_the_union_with_check_rows():
    seed = seeded()
    n = 310
    q, k, v = rand_qkv(n, seed=seed)
    m = delta(check_every=1)
    seen = []
    m.tracer = lambda *a: seen.append(a[4])
    _, pairs = m.prefill_seq(ctx_for(n, n), q, k, v)
    sel = seen[-1]
    expect = (torch.arange(n) % GAMMA == 0) | (torch.arange(n) % GAMMA == GAMMA // 2)
    assert torch.equal(sel.dense_rows, expect)
    blocks = mask_from_indices(sel.indices, -(-n // B))
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    tokens = blocks.repeat_interleave(B, 1).repeat_interleave(B, 2)[:, :n, :n] & causal
    union = tokens | sel.dense_rows[None, :, None] & causal
    assert pairs == float(union.sum()), f"seed {seed}"


def test_config_defaults_and_validation():
    cfg = model_cfg()
    m = create_backend("delta", cfg)
    assert m.config.mode == "far-merge" and m.config.tail_len == 128 and m.config.check_every == 16
    assert m.prefill_density is None  # no density: the base's window, the dense rows on top
    with_density = create_backend("delta", cfg, density=0.9, block_size=16)
    assert with_density.config.tail_len == 0  # a dense tail cannot share a budget
    share = 1 / 64 + 1 / 1024
    d = with_density.base.layer_density
    assert with_density.prefill_density == pytest.approx((d - share) / (1 - share))
    for bad in ({"alpha": 1.5}, {"check_every": -1}, {"tail": -1}, {"density": 0.9, "tail": 64}):
        with pytest.raises(ValueError):
            create_backend("delta", cfg, **bad)
    spec = {"dense_layers": [0, 1]}  # the paper's dense layers 0 and 1 of 3: layer 2 alone takes the budget
    tight = create_backend("delta", cfg, density=0.7, block_size=16, **spec)  # layer 2: 0.1, the base's prefill 0.085
    with pytest.raises(ValueError, match=r"with Delta's dense rows, 0\.0166 of a layer's pairs"):
        tight.check_request(100, 110)  # the sink and diagonal blocks alone are more
    tight.check_request(2000, 2010)
    with pytest.raises(ValueError, match="no more than Delta's dense rows alone attend"):
        create_backend("delta", cfg, density=0.67, **spec)  # layer 2, the one sparse: 0.01, below 1/64 + 1/1024
    assert create_backend("delta", cfg, density=0.67, mode="sparse-only").prefill_density is None
    recompute = create_backend("delta", cfg, density=0.9, mode="recompute")
    assert recompute.prefill_density == pytest.approx((d - 1 / 64) / (1 - 1 / 64))  # anchors alone


# ---- honest density on a tiny model ----------------------------------------------------------------------
LAYERS, DENSE = 4, (0,)


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_hf_config(num_kv_heads=2, group=2, layers=LAYERS)
    cfg.max_position_embeddings = 4096
    seed = seeded()
    return model_from_state(cfg, random_state(cfg, seed=seed).state_dict()), seed


def _measure(model, backend, n: int, steps: int, g: torch.Generator) -> tuple[float, float]:
    return measure_density(model, backend, n, steps, g, B)[1:]


@pytest.mark.parametrize("base,params,mode", [("streaming", {"sink_tokens": B}, "far-merge"),
                                              ("streaming", {"sink_tokens": B}, "delta"),
                                              ("sketch_walk", {}, "far-merge"), ("quest", {}, "far-merge")])
def test_measured_density_is_the_target_with_the_dense_rows_inside(tiny, base, params, mode):
    """Delta's anchors and check rows count inside --density: the base's prefill gets what they leave, so the
    measured prefill density (every layer, the dense one included) is the target within 0.01 at 2000-4000
    tokens; decode is the base's at the whole budget."""
    net, seed = tiny
    g = torch.Generator().manual_seed(seed)
    target = float(torch.empty(()).uniform_(0.35, 0.6, generator=g))
    for n in (2000, 4000 - 24):
        backend = create_backend("delta", net.cfg, density=target, dense_layers=DENSE, block_size=B, mode=mode,
                                 base=base, base_params=params, check_every=4)
        backend.check_request(n, n + 24)
        prefill, decode = _measure(net, backend, n, 24, g)
        where = f"delta/{mode} over {base} n={n} target={target:.4f} seed={seed}"
        assert prefill == pytest.approx(target, abs=0.01), where
        assert decode == pytest.approx(target, abs=0.01), where


def test_eval_reports_the_fitted_correction_and_its_fallback(tiny):
    """``raysparse eval`` carries Delta's fit: alpha, the fallback fraction (the table's ``fallback`` column) and
    the check rows' error ratio, per layer (None at the dense layers 0 and 1); the paper's mode fits nothing."""
    from test_eval import CharTokenizer

    from raysparse.eval.config import EvalConfig
    from raysparse.eval.harness import run_eval
    from raysparse.eval.report import method_columns, table
    from raysparse.eval.settings import parse_method_params
    from raysparse.workload import synthetic_haystack

    net, seed = tiny
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = EvalConfig(methods=("delta",), densities=(0.75,), tasks=("single_needle",), samples=1,
                         context_tokens=640, max_new_tokens=2, rows=8, decode_ppl_tokens=0,
                         method_params=parse_method_params(["delta:mode=far-merge,delta", "delta:block_size=16",
                                                            "delta:gamma=16", "delta:dense_layers=[0,1]"]))
        report = run_eval(net, CharTokenizer(), cfg, synthetic_haystack(300), "synthetic", model_name="tiny")
    finally:
        torch.set_num_threads(before)
    runs = {r["params"]["mode"]: r for r in report["runs"] if r["method"] == "delta"}
    assert all(r["status"] == "ok" for r in runs.values()), [r["error"] for r in runs.values()]
    fit = runs["far-merge"]["extras"]["delta"]
    assert 0 <= fit["alpha"] <= 1 and 0 <= fit["fallback"] <= 1 and fit["check_error_ratio"] > 0, f"seed {seed}"
    assert fit["alpha_per_layer"][:2] == [None, None] and all(a is not None for a in fit["alpha_per_layer"][2:])
    assert method_columns(runs["far-merge"])["fallback"] == fit["fallback"]
    assert runs["delta"]["extras"]["delta"]["alpha"] is None and method_columns(runs["delta"])["fallback"] is None
    assert runs["far-merge"]["density_prefill"] == pytest.approx(0.75, abs=0.02), f"seed {seed}"
    assert table(report).row_count == len(report["runs"])
