"""Sketch&Walk's fixed-shape batched decode for the paired head scorings (pair / pair-lse, key parts, part or
block decode; run eagerly here) against the reference per-sequence decode: the same selection lists and
units, the same logits, the same metered density and the same part sums, over several steps of a ragged,
padded batch whose sequences cross block and part boundaries. Every graph run first decodes and releases a
long sequence, so the batch's pages are reused ones whose part sums are stale."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICES, prefill_then_decode, tiny_model, whole_model_density

from raysparse.decode_graphs import DecodeGraphs
from raysparse.kv_cache import KVCache
from raysparse.methods.registry import create_backend
from raysparse.methods.sketch_walk_config import SketchWalkConfig
from raysparse.methods.sketch_walk_parts import PartsDecode, order_keys
from raysparse.runtime_config import RuntimeConfig


@pytest.fixture(scope="module", params=DEVICES)
def model(request):
    return tiny_model(request.param, 2, 2, 5)


FILLER = 9, 400  # the released sequence's id and length: 26 pages, every page the batch then takes


def _fill_and_release(model, cache, backend, graphs, seed: int) -> None:
    """A long sequence prefilled, decoded a step through the graph path (its prefill sums entered into its
    pages), then released: its pages return to the free list with their sums, and the next sequences reuse
    them (the cache hands out the most recently freed pages first). It runs under another instance of the
    method (another density and head combine, the same sketch and parts), which shares the state."""
    sid, n = FILLER
    g = torch.Generator().manual_seed(seed + 1)
    cfg = backend.config
    other = create_backend("sketch_walk", model.cfg, block_size=cfg.block_size, walk=cfg.walk,
                           sub_blocks=cfg.sub_blocks, decode_unit=cfg.decode_unit,
                           density=whole_model_density(0.55, 5),
                           heads="pair" if cfg.heads == "pair-lse" else "pair-lse")
    assert other.build_batched(cache, max_batch=4, state_budget_bytes=0)  # nothing new to allocate
    mine, theirs = other.batch_decoder, backend.batch_decoder
    assert mine.ks is theirs.ks and mine.entered is theirs.entered
    cache.allocate(sid, n + 2)
    model(torch.randint(0, 97, (n,), generator=g).to(cache.device), cache.prepare([sid], [n], True), cache, other)
    graphs.decode("filler", other, [sid], [int(torch.randint(0, 97, (), generator=g))])
    pages = torch.tensor(cache.page_list(sid))
    assert backend.batch_decoder.ks[:, pages * cfg.sub_blocks].abs().amin(-1).gt(0).all()  # all sums set
    other.release(sid)
    cache.free(sid)


def _run(model, params, lens, steps, graph: bool, seed: int, reduced: list | None = None,
         capture: bool | None = None, caches: list | None = None):
    g = torch.Generator().manual_seed(seed)
    dev = model.lm_head.weight.device
    cache = KVCache(model.cfg, 48, 16, device=dev)
    if caches is not None:
        caches.append(cache)
    backend = create_backend("sketch_walk", model.cfg, block_size=16, walk="one-hop", **params)
    if reduced is not None:  # a group of one: the tensor-parallel seam runs, every value stays
        def head_reduce(x):
            reduced.append(x.dtype)
            return x.clone()

        backend.head_reduce = head_reduce
    picks: list = []
    graphs = None
    if graph:
        assert backend.build_batched(cache, max_batch=4)
        assert isinstance(backend.batch_decoder, PartsDecode)
        graphs = DecodeGraphs(model, cache, max_batch=4, capture=capture)
        _fill_and_release(model, cache, backend, graphs, seed)
        if not graphs.capture:  # a captured graph replays without Python: only the eager run records lists
            real = backend.batch_decoder._selection

            def spy(*args):
                idx, unit = real(*args)
                picks.append((idx.clone(), unit))
                return idx, unit

            backend.batch_decoder._selection = spy
    else:
        def tracer(ctx, q, k, v, sel, out):
            if ctx.q_start == ctx.n - 1:
                picks.append((ctx.layer, ctx.seq_id, sel.indices.clone(), sel.block_size))

        backend.tracer = tracer
    # the decode steps' reduces only
    logits = prefill_then_decode(model, cache, backend, graphs, lens, steps, g, graph,
                                 after_prefill=reduced.clear if reduced is not None else None)
    return picks, logits, backend


def _assert_same_sums(backend, cache, ref_cache, lens: list[int], steps: int, tol: float) -> None:
    """The graph path's part sums of every sequence and sparse layer, read through its pages, are the
    reference's (the filled parts: the others may hold a reused page's stale sums)."""
    path, P = backend.batch_decoder, backend.config.sub_blocks
    size, dev = backend.config.block_size // P, path.ks.device
    for layer, li in path.index.items():
        for sid, n in enumerate(lens):
            held = -(-(n + steps) // size)
            pages = torch.tensor(cache.page_list(sid), device=dev)
            rows = (pages[:, None] * P + torch.arange(P, device=dev)).flatten()[:held]
            want = ref_cache.metadata[layer][sid]["ks"][:held]
            torch.testing.assert_close(path.ks[li, rows], want, rtol=tol, atol=tol)


# Six cases cover every pair of settings (heads x P, P x unit, heads x unit) in the fast run; the other six
# of the full cross run with the slow tests.
_FAST = {("pair", 1, "part"), ("pair-lse", 1, "block"), ("pair", 4, "block"), ("pair-lse", 4, "part"),
         ("pair", 8, "part"), ("pair-lse", 8, "block")}
SCORINGS = [pytest.param({"heads": h, "sub_blocks": p, "decode_unit": u}, id=f"{h}-P{p}-{u}",
                         marks=() if (h, p, u) in _FAST else pytest.mark.slow)
            for h in ("pair", "pair-lse") for p in (1, 4, 8) for u in ("part", "block")] + [
    # every query head scoring the parts on its own
    pytest.param({"heads": "pair-lse", "sub_blocks": 4, "decode_unit": "part", "decode_query": "heads"},
                 id="pair-lse-P4-part-heads"),
    pytest.param({"heads": "pair", "sub_blocks": 8, "decode_unit": "part", "decode_query": "heads"},
                 id="pair-P8-part-heads", marks=pytest.mark.slow)]


@pytest.mark.parametrize("scoring", SCORINGS)
def test_paired_graph_decode_matches_reference(model, scoring):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    params = {**scoring, "density": whole_model_density(float(torch.empty(()).uniform_(0.15, 0.5)), 5),
              "local_blocks": 1 + seed % 2,
              "token_query": ("last", "decode")[seed % 3 == 0]}
    # three sequences in a batch bucket of 4 (one padded row); 14 + 4 steps crosses from a partial block
    # into the next, 158 + 4 crosses a block, parts cross every 2 or 4 tokens
    lens, steps = [100, 14, 158], 4
    ref_red, got_red = ([], []) if scoring["sub_blocks"] == 4 else (None, None)
    ref_caches, got_caches = [], []
    ref_picks, ref_logits, ref_b = _run(model, params, lens, steps, False, seed, ref_red, caches=ref_caches)
    got_picks, got_logits, got_b = _run(model, params, lens, steps, True, seed, got_red, caches=got_caches)
    tol = 1e-4 if got_logits.device.type == "cpu" else 2e-3
    _assert_same_sums(got_b, got_caches[0], ref_caches[0], lens, steps, tol)
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


def test_switch_and_settings_gate_the_paired_path(model):
    if model.lm_head.weight.is_cuda:
        pytest.skip("host-side bookkeeping: the CPU run covers it")
    cache = KVCache(model.cfg, 40, 16)

    def attach(max_batch: int = 2, budget: int = 8 << 30, **params):
        backend = create_backend("sketch_walk", model.cfg,
                                 **{"block_size": 16, "density": whole_model_density(0.3, 5), **params})
        return backend.build_batched(cache, max_batch=max_batch, state_budget_bytes=budget), backend

    ok, backend = attach()  # the default scoring: on by default
    assert ok and isinstance(backend.batch_decoder, PartsDecode)
    assert backend.batch_decoder.cfg.part_scores and backend.batch_decoder.cfg.part_select  # kernels on by default
    ok, backend = attach(graph_paired=False)
    assert not ok and backend.batch_decoder is None
    ok, backend = attach(part_scores=False)
    assert ok and backend.batch_decoder.cfg is backend.config  # the path's kernels follow the method's config
    assert not backend.batch_decoder.cfg.part_scores and backend.batch_decoder.cfg.part_select
    with pytest.raises(ValueError, match="graph_paired"):
        create_backend("sketch_walk", model.cfg, graph_paired="off")
    assert not attach(walk="product", decode_unit="block")[0]
    assert not attach(token_query="never")[0]
    assert not attach(heads="kv")[0]
    assert not attach(block_size=32)[0]  # page size != block size


@pytest.mark.parametrize("field,bad", [("graph_paired", "off"), ("part_scores", 1), ("part_select", None),
                                       ("walk_select", "on")])
def test_bad_switch_values_fail_at_construction(field, bad):
    with pytest.raises(ValueError, match=f"{field} must be true or false"):
        SketchWalkConfig(**{field: bad})


def test_the_switches_are_the_methods_parameters_not_the_engines():
    from dataclasses import fields

    from helpers import tiny_hf_config

    from raysparse.config import ModelConfig
    from raysparse.methods.registry import get_method

    switches = {"graph_paired", "part_scores", "part_select", "walk_select"}
    assert switches <= get_method("sketch_walk").params
    assert not switches & {f.name for f in fields(RuntimeConfig)}
    cfg = ModelConfig.from_hf(tiny_hf_config(num_kv_heads=2, group=2, layers=4))
    got = create_backend("sketch_walk", cfg, **{name: False for name in switches}).config
    assert not any(getattr(got, name) for name in switches)
    assert all(getattr(SketchWalkConfig(), name) for name in switches)  # on by default


def test_state_is_one_page_indexed_allocation(model, caplog):
    """(num_pages + 1) * P rows per sparse layer, whatever the batch: the budget is checked against that."""
    if model.lm_head.weight.is_cuda:
        pytest.skip("host-side bookkeeping: the CPU run covers it")
    pages, parts = int(torch.randint(8, 60, ())), (1, 2, 4, 8)[int(torch.randint(0, 4, ()))]
    cache = KVCache(model.cfg, pages, 16)
    backend = create_backend("sketch_walk", model.cfg, block_size=16, sub_blocks=parts,
                             density=whole_model_density(0.2, 5))
    need = PartsDecode.state_bytes(backend, pages, cache.num_kv_heads)
    sparse = sum(not backend.is_dense_layer(i) for i in range(model.cfg.num_layers))
    assert need == sparse * 4 * (pages + 1) * parts * cache.num_kv_heads * backend.srht.sketch_dim
    for max_batch in (1, 64):  # the batch does not size it
        cache = KVCache(model.cfg, pages, 16)
        caplog.clear()
        assert not backend.build_batched(cache, max_batch=max_batch, state_budget_bytes=need - 1)
        assert "exceeds its budget" in caplog.text
        assert backend.build_batched(cache, max_batch=max_batch, state_budget_bytes=need)
        ks = backend.batch_decoder.ks
        assert ks.shape == (sparse, (pages + 1) * parts, cache.num_kv_heads, backend.srht.sketch_dim)
        assert ks.numel() * ks.element_size() == need


def test_instances_with_one_sketch_share_one_state(model):
    """The part sums depend on the sketch, the parts and the sparse layers only: instances that differ in
    density or head combine share one allocation; another sketch, part count or dense layers gets its own."""
    if model.lm_head.weight.is_cuda:
        pytest.skip("host-side bookkeeping: the CPU run covers it")
    cache = KVCache(model.cfg, 12, 16)

    def attach(**params):
        backend = create_backend("sketch_walk", model.cfg,
                                 **{"block_size": 16, "density": whole_model_density(0.2, 5), **params})
        assert backend.build_batched(cache, max_batch=2)
        return backend.batch_decoder.ks

    first = attach(density=whole_model_density(0.1, 5))
    assert attach(density=whole_model_density(0.3, 5), heads="pair") is first
    assert attach(density=whole_model_density(0.2, 5), decode_unit="block") is first
    others = [attach(sub_blocks=4), attach(sketch_dim=8), attach(seed=5),
              attach(dense_layers=(0,), density=whole_model_density(0.2, 5, 1))]
    assert all(ks is not first for ks in others) and len({id(ks) for ks in others}) == len(others)
    assert len(cache.shared_state) == 1 + len(others)


def test_no_room_for_the_state_decodes_eagerly(model, monkeypatch, caplog):
    """The state is allocated at a method's first use: out of device memory there, the method keeps its eager
    decode instead of failing the request, and says so in the log."""
    if model.lm_head.weight.is_cuda:
        pytest.skip("host-side bookkeeping: the CPU run covers it")

    def no_room(*_args, **_kwargs):
        raise torch.OutOfMemoryError("no room")

    monkeypatch.setattr(PartsDecode, "__init__", no_room)
    backend = create_backend("sketch_walk", model.cfg, block_size=16, density=whole_model_density(0.2, 5))
    with caplog.at_level("WARNING", logger="raysparse.methods.sketch_walk"):
        assert not backend.build_batched(KVCache(model.cfg, 8, 16), max_batch=2)
    assert backend.batch_decoder is None
    assert "no device memory left" in caplog.text and "decoding per sequence" in caplog.text


def test_order_keys_order_like_the_values():
    x = torch.randn(4096) * torch.tensor([1e-30, 1.0, 1e30]).repeat(4096 // 3 + 1)[:4096]
    x[:3] = torch.tensor([0.0, -0.0, -float("inf")])
    keys = order_keys(x)
    i, j = torch.randint(0, 4096, (2, 20000))
    assert torch.equal(keys[i] < keys[j], x[i] < x[j]) and torch.equal(keys[i] == keys[j], x[i] == x[j])
