"""A method's per-step state is built once per step, by the declared plan (``AttentionBackend.plan_layers``)
before the model's layers run, and every layer reads that plan: one method per family (block prefill: Quest;
token decode: SOCKET; speculative verification: SpecAttn; and ETF's frozen rows, which the model asks of the
method at every layer). No layer call of the method writes per-step state of its own into the batch: the plan
step alone does (the plan, a batched prefill's packed geometry, an eager batched decode's placed rows)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from helpers import fresh_cache, tiny_model

from raysparse.attention import AttentionBackend, DenseAttention, ShardContext
from raysparse.kv_cache import BatchMeta, KVCache
from raysparse.methods.registry import create_backend
from raysparse.specattn import SpecAttn, SpecAttnConfig

# What the cache and the graph runner keep per step (the page table and its host rows, the graph flag), not a
# method.
GENERIC = {"paged", "paged_host", "graph"}


class Counting:
    """Counts ``backend.plan_layers`` calls per batch, and checks after each forward that the layers left only
    what the plan step wrote (the plan; a batched prefill's ``PrefillStep``) and the cache's entries in the
    batch."""

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend, self.calls = backend, []
        real = backend.plan_layers

        def plan_layers(cache: KVCache, batch: BatchMeta) -> Any:
            out = real(cache, batch)
            self.calls.append((batch, out))
            return out

        backend.plan_layers = plan_layers  # type: ignore[method-assign]

    def forward(self, model, ids: torch.Tensor, batch: BatchMeta, cache: KVCache, **kw: Any) -> torch.Tensor:
        before = len(self.calls)
        planned: list[set[Any]] = []
        real = self.backend.begin_step

        def begin_step(cache: KVCache, batch: BatchMeta) -> None:
            real(cache, batch)
            planned.append(set(batch.extras))

        self.backend.begin_step = begin_step  # type: ignore[method-assign]
        try:
            out = model(ids, batch, cache, self.backend, **kw)
        finally:
            del self.backend.begin_step
        assert [b for b, _ in self.calls[before:]] == [batch], "the plan is built once per step"
        own = {k for k in batch.extras if k not in GENERIC}
        assert ("plan", id(self.backend)) in own and own <= {("plan", id(self.backend)),
                                                             ("prefill-step", id(self.backend))}, own
        assert len(planned) == 1 and own <= planned[0], f"written by a layer call: {own - planned[0]}"
        return out

    def plans(self) -> list[Any]:
        return [p for _, p in self.calls]


def _model_and_cache(tokens: int = 512):
    model = tiny_model("cpu", num_kv_heads=2, group=2, layers=4, seed=3)
    return model, fresh_cache(model, tokens, page_size=16)


def test_quest_plans_its_prefill_and_decode_once_per_step():
    """Block prefill (and Quest's decode): a ragged two-prompt prefill on the batched seam, then decode steps."""
    model, cache = _model_and_cache()
    quest = create_backend("quest", model.cfg, density=0.3, block_size=16, page_size=16)
    quest.bind(ShardContext(cache=cache))
    run = Counting(quest)
    g = torch.Generator().manual_seed(0)
    lens = [70, 45]
    for sid, n in enumerate(lens):
        cache.allocate(sid, n + 4)
    run.forward(model, torch.randint(0, 97, (sum(lens),), generator=g), cache.prepare([0, 1], lens, True), cache)
    prefill = run.plans()[-1]
    assert prefill.closing_rows is not None and prefill.widths is not None and prefill.decode_k is None
    for _ in range(3):
        run.forward(model, torch.randint(0, 97, (2,), generator=g), cache.prepare([0, 1], [1, 1], False), cache)
        assert run.plans()[-1].decode_k.shape == (2 * cache.num_kv_heads,)
    assert len(run.calls) == 4


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_socket_plans_each_decode_step_once(monkeypatch: pytest.MonkeyPatch, kernels: str):
    """Token decode: every decode step's budgets (and, off Triton, the scores' bias) come from one plan; a
    prefill plans nothing."""
    if kernels == "triton" and torch.cuda.is_available():
        pytest.skip("Triton over CPU tensors runs in Triton's interpreter only, which a GPU machine does not set")
    if kernels == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("RAYSPARSE_KERNELS", kernels)
    model, cache = _model_and_cache()
    socket = create_backend("socket", model.cfg, density=0.3, sink_tokens=4, local_tokens=8, tables=4, planes=4)
    socket.bind(ShardContext(cache=cache))
    run = Counting(socket)
    g = torch.Generator().manual_seed(1)
    lens = [60, 33]
    for sid, n in enumerate(lens):
        cache.allocate(sid, n + 4)
        run.forward(model, torch.randint(0, 97, (n,), generator=g), cache.prepare([sid], [n], True), cache)
    assert run.plans() == [None, None]
    for _ in range(3):
        run.forward(model, torch.randint(0, 97, (2,), generator=g), cache.prepare([0, 1], [1, 1], False), cache)
        step = run.plans()[-1]
        assert step.top.shape == (2 * cache.num_kv_heads,)
        assert (step.bias is None) == (kernels == "triton")
    assert len(run.calls) == 5


def test_specattn_plans_a_verification_step_once():
    """Speculative: a ragged verification step's rows and key lists are one plan for every layer; the
    prompts' prefill (no verification plans) plans nothing."""
    model, cache = _model_and_cache(256)
    h_kv, L = model.num_kv_heads, model.cfg.num_layers
    backend = SpecAttn(model.cfg, SpecAttnConfig(top_p=0.6, chunk_size=4, dense_layers=(0,), search_iters=60))
    run = Counting(backend)
    g = torch.Generator().manual_seed(2)
    ctx, new = [37, 20], [3, 2]
    ids = [torch.randint(0, 97, (c + m,), generator=g) for c, m in zip(ctx, new, strict=True)]
    for sid, (c, m) in enumerate(zip(ctx, new, strict=True)):
        cache.allocate(sid, c + m)
        model(ids[sid][:c], cache.prepare([sid], [c], True), cache, DenseAttention(L))
        rows = {d: [torch.softmax(torch.randn(h_kv, c + s + 1, generator=g) * 3, -1) for s in range(m - 1)]
                for d in backend.needed_draft_layers()}
        backend.plan(sid, c, m, rows)
    batch = cache.prepare([0, 1], new, True)
    run.forward(model, torch.cat([ids[sid][c:] for sid, c in enumerate(ctx)]), batch, cache, all_logits=True)
    (_, rows), = run.calls
    assert rows is not None and rows[2].shape == (sum(new),)  # each position's row: its sequence


def test_a_wrapped_base_plans_its_prefill_at_the_density_it_selects_at():
    """Delta swaps its base's layer density for the base's share of the budget while the base selects a
    prefill; the base's plan of that step is built under the same swap, so its widths are the ones its
    selection needs (Quest's static list widths here)."""
    model, cache = _model_and_cache(1024)
    delta = create_backend("delta", model.cfg, base="quest", density=0.5, gamma=16, block_size=16,
                           base_params={"block_size": 16, "page_size": 16})
    quest = delta.base
    assert delta.prefill_density is not None and delta.prefill_density < quest.layer_density
    lens = [400, 250]
    for sid, n in enumerate(lens):
        cache.allocate(sid, n)
    batch = cache.prepare([0, 1], lens, True)
    model(torch.randint(0, 97, (sum(lens),)), batch, cache, delta)
    with delta._prefill_budget():
        want = quest.list_widths(batch.q_lens, batch.ctx_lens)
    assert want != quest.list_widths(batch.q_lens, batch.ctx_lens)  # the swap matters at these lengths
    assert quest.layer_plan(cache, batch).widths == want


def test_etf_plans_its_frozen_rows_once_per_step():
    """ETF's frozen rows, asked by the model's every layer and by the batched selection, are the plan's masks
    (one per freezing layer, built before the layers); the layers write nothing into the batch. A layer driven
    with no plan builds the same mask itself."""
    model, cache = _model_and_cache()
    etf = create_backend("etf", model.cfg, block_size=16, start_layer=1, sink=4)  # layers 2 and 3 freeze
    run = Counting(etf)
    g = torch.Generator().manual_seed(4)
    lens = [120, 90]
    for sid, n in enumerate(lens):
        cache.allocate(sid, n + 4)
    batch = cache.prepare([0, 1], lens, True)
    run.forward(model, torch.randint(0, 97, (sum(lens),), generator=g), batch, cache)
    (plan,) = run.plans()
    freezing = [layer for layer in range(model.cfg.num_layers) if etf.etf_frac(layer) > 0]
    assert freezing and sorted(plan) == freezing
    assert any(plan[layer] is not None and plan[layer].any() for layer in freezing), "no row frozen: a weak test"
    for layer in freezing:
        assert etf.frozen_rows(layer, batch) is plan[layer]
        alone = etf.frozen_rows(layer, dataclasses.replace(batch, extras={}))  # no plan: built on the spot
        assert (alone is None) == (plan[layer] is None)
        if alone is not None:
            assert torch.equal(alone, plan[layer])
    for _ in range(2):  # decode steps freeze nothing and plan nothing of ETF's
        run.forward(model, torch.randint(0, 97, (2,), generator=g), cache.prepare([0, 1], [1, 1], False), cache)
        assert run.plans()[-1] is None
