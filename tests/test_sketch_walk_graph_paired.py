"""Sketch&Walk's fixed-shape batched decode for the paired head scorings (pair / pair-lse, key parts, part or
block decode; run eagerly here) against the reference per-sequence decode: the same selection lists and
units, the same logits and the same metered density, over several steps of a ragged, padded batch whose
sequences cross block and part boundaries."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICES, prefill_then_decode, tiny_model

from raysparse.decode_graphs import DecodeGraphs
from raysparse.kv_cache import KVCache
from raysparse.methods.registry import create_backend
from raysparse.methods.sketch_walk_graph import attach_graph_decode
from raysparse.methods.sketch_walk_graph_paired import PAIRED_ENV, PairedGraphDecode, order_keys


@pytest.fixture(scope="module", params=DEVICES)
def model(request):
    return tiny_model(request.param, 2, 2, 5)


def _run(model, params, lens, steps, graph: bool, seed: int, reduced: list | None = None,
         capture: bool | None = None):
    g = torch.Generator().manual_seed(seed)
    dev = model.lm_head.weight.device
    cache = KVCache(model.cfg, 48, 16, device=dev)
    backend = create_backend("sketch_walk", model.cfg, block_size=16, walk="one-hop", **params)
    if reduced is not None:  # a group of one: the tensor-parallel seam runs, every value stays
        def head_reduce(x):
            reduced.append(x.dtype)
            return x.clone()

        backend.head_reduce = head_reduce
    picks: list = []
    graphs = None
    if graph:
        assert attach_graph_decode(backend, cache, max_batch=4)
        assert isinstance(backend.graph_path, PairedGraphDecode)
        graphs = DecodeGraphs(model, cache, max_batch=4, capture=capture)
        if not graphs.capture:  # a captured graph replays without Python: only the eager run records lists
            real = backend.graph_path._selection

            def spy(*args):
                idx, unit = real(*args)
                picks.append((idx.clone(), unit))
                return idx, unit

            backend.graph_path._selection = spy
    else:
        def tracer(ctx, q, k, v, sel, out):
            if ctx.q_start == ctx.n - 1:
                picks.append((ctx.layer, ctx.seq_id, sel.indices.clone(), sel.block_size))

        backend.tracer = tracer
    # the decode steps' reduces only
    logits = prefill_then_decode(model, cache, backend, graphs, lens, steps, g, graph,
                                 after_prefill=reduced.clear if reduced is not None else None)
    return picks, logits, backend


# Six cases cover every pair of settings (heads x P, P x unit, heads x unit) in the fast run; the other six
# of the full cross run with the slow tests.
_FAST = {("pair", 1, "part"), ("pair-lse", 1, "block"), ("pair", 4, "block"), ("pair-lse", 4, "part"),
         ("pair", 8, "part"), ("pair-lse", 8, "block")}
SCORINGS = [pytest.param({"heads": h, "sub_blocks": p, "decode_unit": u}, id=f"{h}-P{p}-{u}",
                         marks=() if (h, p, u) in _FAST else pytest.mark.slow)
            for h in ("pair", "pair-lse") for p in (1, 4, 8) for u in ("part", "block")]


@pytest.mark.parametrize("scoring", SCORINGS)
def test_paired_graph_decode_matches_reference(model, scoring, monkeypatch):
    monkeypatch.setenv(PAIRED_ENV, "on")
    seed = int(torch.randint(0, 2**31 - 1, ()))
    params = {**scoring, "density": float(torch.empty(()).uniform_(0.15, 0.5)), "local_blocks": 1 + seed % 2,
              "token_query": ("last", "decode")[seed % 3 == 0]}
    # three sequences in a batch bucket of 4 (one padded row); 14 + 4 steps crosses from a partial block
    # into the next, 158 + 4 crosses a block, parts cross every 2 or 4 tokens
    lens, steps = [100, 14, 158], 4
    ref_red, got_red = ([], []) if scoring["sub_blocks"] == 4 else (None, None)
    ref_picks, ref_logits, ref_b = _run(model, params, lens, steps, False, seed, ref_red)
    got_picks, got_logits, got_b = _run(model, params, lens, steps, True, seed, got_red)
    tol = 1e-4 if got_logits.device.type == "cpu" else 2e-3
    torch.testing.assert_close(got_logits, ref_logits, rtol=tol, atol=tol)
    assert got_b.meter.attended == pytest.approx(ref_b.meter.attended)
    assert got_b.meter.decode_causal == pytest.approx(ref_b.meter.decode_causal)
    if got_logits.is_cuda:  # captured: the lists come from the same padded path run uncaptured
        got_red = None if got_red is None else []
        got_picks, eager_logits, _ = _run(model, params, lens, steps, True, seed, got_red, capture=False)
        torch.testing.assert_close(eager_logits, got_logits, rtol=tol, atol=tol)
    sparse = [i for i in range(model.cfg.num_layers) if not ref_b.is_dense_layer(i)]
    assert len(got_picks) == steps * len(sparse)
    if got_red is not None:  # one fp64 reduce of the score rows per sparse layer and step, as the reference's
        assert got_red == [torch.float64] * (steps * len(sparse))
        assert ref_red == [torch.float64] * (steps * len(sparse) * len(lens))
    for j, (got, unit) in enumerate(got_picks):
        assert got.shape[0] == 4 and ((got[:, 1:] >= got[:, :-1]) | (got[:, 1:] < 0)).all()
        for row in range(len(lens)):
            layer, sid, want, want_unit = ref_picks[j * len(lens) + row]
            assert (layer, sid, unit) == (sparse[j % len(sparse)], row, want_unit)
            assert (want == want[:1]).all()  # one selection per layer, shared by the KV heads
            mine, ref = got[row][got[row] >= 0], want[0][want[0] >= 0]
            assert torch.equal(mine.long(), ref.long()), f"step {j // len(sparse)} layer {layer} seq {sid}"


def test_switch_and_settings_gate_the_paired_path(model, monkeypatch):
    if model.lm_head.weight.is_cuda:
        pytest.skip("host-side bookkeeping: the CPU run covers it")
    cache = KVCache(model.cfg, 40, 16)

    def attach(**params):
        backend = create_backend("sketch_walk", model.cfg, **{"block_size": 16, "density": 0.3, **params})
        return attach_graph_decode(backend, cache, max_batch=2), backend

    monkeypatch.delenv(PAIRED_ENV, raising=False)
    ok, backend = attach()  # the default scoring: off unless switched on
    assert not ok and backend.graph_path is None
    monkeypatch.setenv(PAIRED_ENV, "maybe")
    with pytest.raises(ValueError, match=PAIRED_ENV):
        attach()
    monkeypatch.setenv(PAIRED_ENV, "on")
    ok, backend = attach()
    assert ok and isinstance(backend.graph_path, PairedGraphDecode)
    assert not attach(walk="product", decode_unit="block")[0]
    assert not attach(token_query="never")[0]
    assert not attach(heads="kv")[0]
    assert not attach(block_size=32)[0]  # page size != block size
    assert not attach_graph_decode(create_backend("sketch_walk", model.cfg, block_size=16), cache, max_batch=4,
                                   state_budget_bytes=1024)


def test_order_keys_order_like_the_values():
    x = torch.randn(4096) * torch.tensor([1e-30, 1.0, 1e30]).repeat(4096 // 3 + 1)[:4096]
    x[:3] = torch.tensor([0.0, -0.0, -float("inf")])
    keys = order_keys(x)
    i, j = torch.randint(0, 4096, (2, 20000))
    assert torch.equal(keys[i] < keys[j], x[i] < x[j]) and torch.equal(keys[i] == keys[j], x[i] == x[j])
