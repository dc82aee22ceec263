"""The attention interface's hooks: a backend that overrides none of them gets their defaults, and generic code
(the model, the graph runner, the shard's binding, the eval) calls a method's overrides."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import fresh_cache, full_logits, tiny_model

from raysparse.attention import AttentionBackend, DenseAttention, ShardContext, StepCollectives
from raysparse.decode_graphs import DecodeGraphs
from raysparse.eval.items import ItemResult, reset_accumulators, snapshot
from raysparse.eval.metrics import FidelityTracer
from raysparse.eval.settings import backend_takes_density
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods.delta_config import DeltaSelection
from raysparse.methods.registry import create_backend, get_method, method_names
from raysparse.methods.selection import indices_from_mask
from raysparse.methods.views import SeqContext
from raysparse.shard_executor import bind_backend


@pytest.fixture(scope="module")
def model():
    return tiny_model("cpu", 2, 2, 4, seed=7)


class Bare(AttentionBackend):
    """Prefill and decode alone (dense attention), no optional hook."""

    name = "bare"

    def __init__(self, num_layers: int) -> None:
        super().__init__(num_layers)
        self.dense = DenseAttention(num_layers)

    def prefill(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        return self.dense.prefill(layer, q, cache, batch)

    def decode(self, layer: int, q: torch.Tensor, cache: KVCache, batch: BatchMeta) -> torch.Tensor:
        return self.dense.decode(layer, q, cache, batch)


def test_a_backend_without_hooks_gets_the_defaults(model):
    b = Bare(model.cfg.num_layers)
    cache = fresh_cache(model, 64)
    cache.allocate(0, 8)
    assert b.frozen_rows(0, cache.prepare([0], [8], True)) is None
    assert not b.speculative and not b.graph_decode and not DecodeGraphs.supports(b)
    b.graph_prepare([0, -1], cache)  # nothing to place
    with pytest.raises(NotImplementedError, match="Bare does not decode from CUDA graphs"):
        b.account_graph_decode([8], cache.num_kv_heads)
    assert b.decode_collectives(4) is None
    assert b.takes_density() and backend_takes_density(b)
    assert b.set_tracer(lambda *args: None) is False
    with pytest.raises(TypeError, match="'bare' has no verification rounds"):
        b.verify_round(model, cache, [0], [[1]], b"", True)
    b.reset_stats()
    assert b.item_sums() == {} and b.wrapped_backends() == () and b.stats_dict() is None
    # the eval over it: no tracer installed, no method sums, not exact (it is no DenseAttention)
    assert reset_accumulators(b, model.cfg.num_layers, rows=8) is None
    item = snapshot(ItemResult("ppl", 0), b, None)
    assert (item.spec, item.cis, item.delta, item.exact) == (None, None, None, False)


def test_the_model_runs_a_backend_without_hooks(model):
    """No frozen rows by default: the model's layers run every row, as dense attention's."""
    ids = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    torch.testing.assert_close(full_logits(model, ids, Bare(model.cfg.num_layers)), full_logits(model, ids),
                               rtol=0, atol=0)


class Recording(DenseAttention):
    """Dense attention recording the hooks generic code calls."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(num_layers)
        self.calls: list[tuple[str, Any]] = []

    def frozen_rows(self, layer: int, batch: BatchMeta) -> torch.Tensor | None:
        self.calls.append(("frozen_rows", layer))
        return None

    def graph_prepare(self, rows: list[int], cache: KVCache) -> None:
        self.calls.append(("graph_prepare", list(rows)))

    def account_graph_decode(self, ctx_lens: list[int], num_kv_heads: int) -> None:
        self.calls.append(("account_graph_decode", list(ctx_lens)))
        super().account_graph_decode(ctx_lens, num_kv_heads)

    def bind(self, shard: ShardContext) -> None:
        self.calls.append(("bind", shard.max_batch))


def test_the_model_and_the_graph_runner_call_the_overrides(model):
    L = model.cfg.num_layers
    b = Recording(L)
    cache = KVCache(model.cfg, 16, 16, device=model.lm_head.weight.device)
    for sid, n in enumerate((5, 9, 3)):
        cache.allocate(sid, n + 4)
        model(torch.arange(n), cache.prepare([sid], [n], True), cache, b)
    assert b.calls == [("frozen_rows", layer) for layer in range(L)] * 3
    b.calls.clear()
    DecodeGraphs(model, cache, max_batch=4).decode("k", b, [0, 1, 2], [1, 2, 3])
    calls = [c for c in b.calls if c[0] != "frozen_rows"]
    assert calls == [("graph_prepare", [0, 1, 2, -1]), ("account_graph_decode", [6, 10, 4])]  # one padded row
    assert b.meter.decode_causal == L * (6 + 10 + 4) * cache.num_kv_heads


class Wrapper(Recording):
    def __init__(self, num_layers: int, inner: AttentionBackend) -> None:
        super().__init__(num_layers)
        self.inner = inner

    def wrapped_backends(self) -> tuple[AttentionBackend, ...]:
        return (self.inner, self.inner)  # named twice, bound once


def test_binding_reaches_the_wrapped_backends_without_a_graph_runner():
    inner = Recording(2)
    outer = Wrapper(2, Wrapper(2, inner))
    bind_backend(outer, ShardContext(max_batch=8))
    assert outer.calls == [("bind", 8)] and outer.inner.calls == [("bind", None)] and inner.calls == [("bind", None)]


def test_sketch_walk_declares_its_collectives_on_the_batched_decode(model):
    sw = create_backend("sketch_walk", model.cfg)
    assert sw.decode_collectives(3) is None  # decodes per sequence: no walk coordinator step
    sw.batch_decoder = object()  # what build_batched leaves when the batched decode runs
    assert sw.decode_collectives(3) == StepCollectives((2, 3, sw.srht.sketch_dim), len(sw.sparse_layers()))
    assert create_backend("streaming", model.cfg).decode_collectives(3) is None


@pytest.mark.parametrize("name", [n for n in method_names() if n != "dense"])
def test_an_instance_takes_density_as_its_registry_entry_says(model, name):
    """PSAW's and ETF's schedule, SpecAttn's top-p: no density; the rest take one."""
    assert backend_takes_density(create_backend(name, model.cfg)) == get_method(name).takes_density


def test_the_eval_installs_a_tracer_in_a_sparse_method(model):
    b = create_backend("streaming", model.cfg)
    tracer = reset_accumulators(b, model.cfg.num_layers, rows=4)
    assert isinstance(tracer, FidelityTracer) and b.tracer is tracer
    assert b.set_tracer(None) is True and b.tracer is None
    assert reset_accumulators(b, model.cfg.num_layers, rows=0) is None and b.tracer is None


def test_method_statistics_reach_an_eval_item_through_the_interface(model):
    L = model.cfg.num_layers
    spec = create_backend("specattn", model.cfg)
    spec.stats.rounds, spec.stats.accepted = 3, 5
    item = snapshot(ItemResult("task", 0), spec, None)
    assert item.spec is not None and (item.spec["rounds"], item.spec["accepted"]) == (3, 5)
    assert item.spec["layer_map"] == list(spec.layer_map.mapping) and item.cis is None and item.delta is None
    reset_accumulators(spec, L, rows=0)
    assert spec.item_sums()["spec"]["rounds"] == 0

    cis = create_backend("cis", model.cfg)
    cis._retrievals[2], cis._head_steps[2] = 5, 10
    item = snapshot(ItemResult("task", 0), cis, None)
    assert item.cis == ([0.0, 0.0, 5.0, 0.0], [0.0, 0.0, 10.0, 0.0]) and item.spec is None
    reset_accumulators(cis, L, rows=0)
    assert cis.item_sums() == {"cis": ([0.0] * L, [0.0] * L)}
    assert create_backend("psaw", model.cfg).item_sums() == {}  # no retrievals without CIS

    delta = create_backend("delta", model.cfg)
    assert delta.wrapped_backends() == (delta.base,)
    item = snapshot(ItemResult("ppl", 0), delta, None)
    assert item.delta == delta.fit_sums() and item.spec is None and item.cis is None
    assert snapshot(ItemResult("ppl", 0), DenseAttention(L), None).exact


def test_the_tracer_counts_the_dense_rows_of_a_delta_prefill_as_full():
    g = torch.Generator().manual_seed(5)
    h_kv, n, d, b = 2, 64, 16, 16
    q, k, v = torch.randn(n, 2 * h_kv, d, generator=g), torch.randn(h_kv, n, d, generator=g), torch.randn(h_kv, n, d)
    nb = n // b
    diag = indices_from_mask(torch.eye(nb, dtype=torch.bool).expand(h_kv, nb, nb))
    sums = []
    for dense in (False, True):
        tracer = FidelityTracer(num_layers=1, rows=n)
        sel = DeltaSelection(diag, b, torch.full((n,), dense), gamma=8, mode="far-merge")
        tracer(SeqContext(0, 0, 0, n, {}), q, k, v, sel, torch.zeros_like(q))
        sums.append(tracer.summary()["retained"]["prefill_per_layer"][0])
    assert sums[0] < 1 - 1e-3 and sums[1] == pytest.approx(1.0, abs=1e-5)
