"""Delta attention against brute force: dense rows, the correction, the dense tail, modes and density."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import whole_model_density
from test_baselines import H_KV, G, ctx_for, model_cfg, rand_qkv

from raysparse.attention import causal_pairs, dense_attention
from raysparse.kernels.reference import strided_dense_attention
from raysparse.methods.delta import Delta
from raysparse.methods.delta_config import DeltaConfig, DeltaSelection
from raysparse.methods.registry import create_backend
from raysparse.methods.selection import mask_from_indices
from raysparse.methods.views import SeqContext

GAMMA = 16
BASE = {"sink_tokens": 16, "window": 48}


def delta(mode: str = "delta", base: str = "streaming", tail: int = 128, **base_params) -> Delta:
    params = base_params or dict(BASE) if base == "streaming" else dict(base_params)
    if "density" in params:  # the tests give the base's per-layer budget: the whole model's that yields it (a
        # config built directly keeps the paper's dense layers 0 and 1, which Delta hands its base)
        params["density"] = whole_model_density(params["density"], model_cfg().num_layers, 2)
    return Delta(model_cfg(), DeltaConfig(block_size=16, gamma=GAMMA, mode=mode, tail=tail, base=base,
                                          base_params=params))


def run(m: Delta, q, k, v, n_q: int | None = None, state: dict | None = None):
    n = k.shape[1]
    n_q = q.shape[0] if n_q is None else n_q
    return m.prefill_seq(ctx_for(n, n_q, state), q, k, v)


def brute_delta(o_sparse: torch.Tensor, o_dense: torch.Tensor, q_start: int, tail_lo: int) -> torch.Tensor:
    out = o_sparse.clone()
    for r in range(o_sparse.shape[0]):
        i = q_start + r
        a = (i // GAMMA) * GAMMA - q_start
        if i >= tail_lo:
            out[r] = o_dense[r]
        elif a >= 0:
            out[r] = o_sparse[r] + (o_dense[a] - o_sparse[a])
    return out


@pytest.mark.parametrize("n,n_q", [(301, 301), (301, 120)])
def test_strided_dense_attention_matches_dense_rows(n, n_q):
    q, k, v = rand_qkv(n, n_q)
    out, lse = strided_dense_attention(q, k, v, GAMMA, n - n_q)
    first = (-(n - n_q)) % GAMMA
    assert torch.allclose(out, dense_attention(q, k, v)[first::GAMMA], atol=1e-5)
    for r in range(out.shape[0]):
        p = n - n_q + first + r * GAMMA
        for h in range(H_KV * G):
            s = q[first + r * GAMMA, h] @ k[h // G, : p + 1].T / math.sqrt(q.shape[-1])
            assert abs(float(torch.logsumexp(s, 0)) - float(lse[r, h])) < 1e-4


@pytest.mark.parametrize("base", ["streaming", "oracle", "quest"])
def test_delta_rows_dense_correction_elsewhere_and_dense_tail(base):
    n = 333
    q, k, v = rand_qkv(n)
    m = delta(base=base, **({"density": 0.2} if base != "streaming" else {}))
    out, _ = run(m, q, k, v)
    o_sparse, _ = m.base.prefill_seq(ctx_for(n, n), q, k, v)
    o_dense = dense_attention(q, k, v)
    assert (out[::GAMMA] - o_dense[::GAMMA]).abs().max() < 1e-5  # rows in R are exactly dense
    tail_lo = n - (n % GAMMA + 128)
    assert (out[tail_lo:] - o_dense[tail_lo:]).abs().max() < 1e-5  # the dense tail
    assert (out[tail_lo - 1] - o_dense[tail_lo - 1]).abs().max() > 1e-3  # and no further
    assert (out - brute_delta(o_sparse, o_dense, 0, tail_lo)).abs().max() < 1e-5
    assert (o_sparse - o_dense)[:tail_lo].abs().max() > 1e-2  # the base really is sparse


def test_tail_uses_gamma_when_larger_than_tail():
    n, gamma = 300, 64
    q, k, v = rand_qkv(n)
    m = Delta(model_cfg(), DeltaConfig(block_size=16, gamma=gamma, tail=32, base_params=BASE))
    out, _ = m.prefill_seq(ctx_for(n, n), q, k, v)
    o_dense = dense_attention(q, k, v)
    tail_lo = n - (n % gamma + gamma)
    assert (out[tail_lo:] - o_dense[tail_lo:]).abs().max() < 1e-5
    assert (out[tail_lo - 1] - o_dense[tail_lo - 1]).abs().max() > 1e-3


def test_recompute_and_sparse_only_modes():
    n = 290
    q, k, v = rand_qkv(n)
    o_dense = dense_attention(q, k, v)
    recompute, sparse_only = delta("recompute"), delta("sparse-only")
    o_sparse, base_pairs = recompute.base.prefill_seq(ctx_for(n, n), q, k, v)
    out, _ = run(recompute, q, k, v)
    tail_lo = n - (n % GAMMA + 128)
    dense_rows = (torch.arange(n) % GAMMA == 0) | (torch.arange(n) >= tail_lo)
    assert (out[dense_rows] - o_dense[dense_rows]).abs().max() < 1e-5
    assert torch.equal(out[~dense_rows], o_sparse[~dense_rows])
    out, pairs = run(sparse_only, q, k, v)
    assert torch.equal(out, o_sparse) and pairs == base_pairs


def test_delta_over_a_density_one_base_is_dense():
    for base, params in [("streaming", {"density": 1.0}), ("oracle", {"density": 1.0})]:
        for n, n_q in [(257, 257), (257, 100)]:
            q, k, v = rand_qkv(n, n_q)
            out, pairs = run(delta(base=base, **params), q, k, v)
            assert (out - dense_attention(q, k, v)).abs().max() < 1e-5
            assert pairs == causal_pairs(n_q, n) * H_KV


@pytest.mark.parametrize("base", ["streaming", "oracle"])
def test_reported_density_counts_the_union_of_base_and_dense_rows(base):
    n, b = 310, 16
    q, k, v = rand_qkv(n)
    m = delta(base=base, **({"density": 0.15} if base == "oracle" else {}))
    seen = []
    m.tracer = lambda *args: seen.append(args[4])
    _, pairs = run(m, q, k, v)
    sel = seen[-1]
    assert isinstance(sel, DeltaSelection) and sel.gamma == GAMMA and sel.mode == "delta"
    blocks = mask_from_indices(sel.indices, -(-n // b))  # [h_kv, nqb, nkb]
    tokens = blocks.repeat_interleave(b, 1).repeat_interleave(b, 2)[:, :n, :n]
    tokens = tokens & torch.ones(n, n, dtype=torch.bool).tril()
    union = tokens | sel.dense_rows[None, :, None] & torch.ones(n, n, dtype=torch.bool).tril()
    assert pairs == float(union.sum())
    assert pairs > float(tokens.sum())  # the dense rows are counted
    base_pairs = float(tokens.sum())
    assert pairs < base_pairs + float((torch.arange(n)[sel.dense_rows] + 1).sum()) * H_KV  # no double count


def test_chunked_prefill_carries_the_delta_across_chunks():
    n, split = 300, 135  # 135 is not a multiple of gamma: rows 128..134 and 135..143 share an anchor
    q, k, v = rand_qkv(n)
    whole, _ = run(delta(tail=0), q, k, v)
    m, state, seq_state = delta(tail=0), {}, {}
    a, _ = m.prefill_seq(SeqContext(2, 0, 0, split, state, seq_state), q[:split], k[:, :split], v[:, :split])
    b, _ = m.prefill_seq(SeqContext(2, 0, split, n, state, seq_state), q[split:], k, v)
    assert (torch.cat([a, b]) - whole).abs().max() < 1e-5


def test_decode_delegates_to_the_base_and_dense_layers_use_the_base_hook():
    n = 200
    q, k, v = rand_qkv(n)
    m = delta()
    o, keys = m.decode_seq(ctx_for(n, 1), q[-1], k, v)
    o_base, keys_base = m.base.decode_seq(ctx_for(n, 1), q[-1], k, v)
    assert torch.equal(o, o_base) and keys == keys_base == (16 + 48) * H_KV
    assert (m.dense_seq(ctx_for(n, n), q, k, v) - dense_attention(q, k, v)).abs().max() < 1e-6


def test_registry_config_and_validation():
    cfg = model_cfg()
    m = create_backend("delta", cfg, base="oracle", base_params={"density": 0.8}, gamma=32, block_size=16)
    assert isinstance(m, Delta) and m.base.name == "oracle" and m.base.config.target_density == 0.8
    assert m.base.config.density == pytest.approx(0.8) and m.base.config.dense_layers == ()  # every layer sparse
    spec = create_backend("delta", cfg, base="oracle", base_params={"density": 0.8}, dense_layers=[0, 1])
    assert spec.base.config.density == pytest.approx(0.4)  # layers 0 and 1 of 3 dense: 0.4 at layer 2
    assert m.base.config.block_size == 16 and m.config.base_params == (("density", 0.8),)
    default = create_backend("delta", cfg)
    assert default.base.name == "streaming" and default.base.config.window == 2048
    assert default.config.gamma == 64 and default.config.density is None
    assert create_backend("delta", cfg, density=0.9).base.config.target_density == 0.9  # --density reaches the base
    for bad in ({"mode": "nope"}, {"gamma": 0}, {"base": "delta"}, {"base": "dense"}, {"base": "no-such"}):
        with pytest.raises(ValueError):
            create_backend("delta", cfg, **bad)


def test_delta_over_a_row_state_base_decodes_per_sequence():
    """A base whose batched decode keeps per-row state (CIS) is not borrowed by Delta: Delta is not offered to
    the graph runner, decodes through the per-sequence path, and meters the base's sparse decode."""
    from helpers import prefill_then_decode, tiny_model

    from raysparse.decode_graphs import DecodeGraphs
    from raysparse.kv_cache import KVCache
    from raysparse.methods.registry import create_backend

    seed = int(torch.randint(0, 2**31 - 1, ()))
    model = tiny_model("cpu", 2, 2, 3)
    lens = [int(x) for x in torch.randint(100, 200, (2,), generator=torch.Generator().manual_seed(seed))]
    backend = create_backend("delta", model.cfg, base="cis", density=0.6, dense_layers=(0,))
    assert not backend.batched_decode and not DecodeGraphs.supports(backend)
    cache = KVCache(model.cfg, 16, 64)
    out = prefill_then_decode(model, cache, backend, DecodeGraphs(model, cache, max_batch=2), lens, 3,
                              torch.Generator().manual_seed(seed), False)
    assert torch.isfinite(out).all(), f"seed {seed}"
    assert backend.meter.decode_overall() < 1.0, f"seed {seed}"
