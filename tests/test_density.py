"""Honest density: ``density`` is the fraction of causal (query, key) pairs the whole model attends, the dense
layers and every forced unit (sinks, local window, diagonal block) inside it, met by prefill and by decode each
on its own; what cannot meet it is refused rather than overshot. The reports carry both phases."""

from __future__ import annotations

import pytest
import torch
from helpers import fresh_cache, measure_density, random_state, tiny_hf_config

from raysparse.loader import model_from_state
from raysparse.methods.budget import host_row_budget, layer_density, prefill_block_budget, prefill_floor
from raysparse.methods.registry import create_backend, get_method

LAYERS, DENSE = 4, (0,)
B = 16  # block = page: the batched prefill and decode seams run, as in serving

# streaming's sinks are one block here, as by default (64 tokens = one 64-token block)
METHODS = [("sketch_walk", {}), ("quest", {}), ("oracle", {}), ("streaming", {"sink_tokens": B})]


@pytest.fixture(scope="module")
def model():
    cfg = tiny_hf_config(num_kv_heads=2, group=2, layers=LAYERS)
    cfg.max_position_embeddings = 4096
    seed = int(torch.randint(0, 2**31 - 1, ()))
    return model_from_state(cfg, random_state(cfg, seed=seed).state_dict()), seed


def _measure(model, backend, n: int, steps: int, g: torch.Generator) -> tuple[float, float, float]:
    return measure_density(model, backend, n, steps, g, B)


@pytest.mark.parametrize("name,params", METHODS)
def test_measured_density_is_the_target_in_prefill_and_decode(model, name, params):
    """At a random target and a few lengths, the meter's prefill, decode and overall densities (every layer and
    KV head, the dense layer included) are the target within 0.01. The decode budgets of Quest (16-token pages)
    and Sketch&Walk (whole blocks of parts) round to their unit, and the newest page is partly filled: up to one
    unit of 16 per row off the budget, 16 of >= 700 keys at 3 sparse layers of 4 (0.017 at 700 keys)."""
    net, seed = model
    g = torch.Generator().manual_seed(seed)
    target = float(torch.empty(()).uniform_(0.35, 0.6, generator=g))
    for n in (700, 1300, 2000):
        backend = create_backend(name, net.cfg, density=target, dense_layers=DENSE, block_size=B, **params)
        backend.check_request(n, n + 24)  # feasible: the forced units fit the budget
        overall, prefill, decode = _measure(net, backend, n, 24, g)
        where = f"{name} n={n} target={target:.4f} seed={seed}"
        assert prefill == pytest.approx(target, abs=0.01), where
        unit = B if name in ("quest", "sketch_walk") else 1
        assert decode == pytest.approx(target, abs=max(0.01, (LAYERS - len(DENSE)) / LAYERS * unit / n)), where
        assert overall == pytest.approx(target, abs=0.01), where


def test_chunked_prefill_attends_the_same_budget(model):
    """A row's budget depends on its absolute block alone: the prompt prefilled in two chunks attends exactly
    what it attends in one."""
    net, seed = model
    g = torch.Generator().manual_seed(seed + 1)
    n, cut = 900, 333
    ids = torch.randint(0, 97, (n,), generator=g)
    pairs = []
    for chunks in ([n], [cut, n - cut]):
        backend = create_backend("quest", net.cfg, density=0.45, dense_layers=DENSE, block_size=B)
        cache = fresh_cache(net, n + B, page_size=B)
        cache.allocate(0, n)
        done = 0
        for c in chunks:
            net(ids[done: done + c], cache.prepare([0], [c], True), cache, backend)
            done += c
        pairs.append(sum(backend.meter.attended))
    assert pairs[0] == pairs[1], f"seed {seed}"


def test_dense_layers_count_inside_the_budget():
    """Each sparse layer gets what makes the layers' mean the target; at or below the dense layers' own share
    the density is refused at construction, naming that share."""
    assert layer_density(0.1, 30, (0, 1)) == pytest.approx(1 / 28)  # (30 * 0.1 - 2) / 28
    assert layer_density(1.0, 30, (0, 1)) == 1.0
    assert layer_density(0.4, 4, ()) == 0.4
    cfg = model_from_state(tiny_hf_config(layers=LAYERS), random_state(tiny_hf_config(layers=LAYERS)).state_dict()).cfg
    for name in ("sketch_walk", "quest", "oracle", "streaming", "socket", "cis"):
        with pytest.raises(ValueError, match=r"dense layers alone attend: 2 of 4 layers .* at least 0\.5000"):
            create_backend(name, cfg, density=0.5, dense_layers=[0, 1])  # the paper's two dense layers, asked for
        assert create_backend(name, cfg, density=0.75, dense_layers=[0, 1]).config.density == pytest.approx(0.5)
        # by default the registry spreads the whole-model density over every layer
        spread = create_backend(name, cfg, density=0.5)
        assert spread.config.dense_layers == () and spread.config.density == pytest.approx(0.5)
    for name in ("socket", "cis", "cpe", "psaw", "streaming", "delta", "sketch_walk"):  # a CLI list, kept as a tuple
        budget = {"density": 0.8} if get_method(name).takes_density else {}
        assert create_backend(name, cfg, dense_layers=[0], **budget).config.dense_layers == (0,)
    for bad in (1, "0,1", [0, -1], [0.5]):  # one line, not a TypeError, for a --param that is not a list
        with pytest.raises(ValueError, match="dense_layers must be"):
            create_backend("socket", cfg, dense_layers=bad)
    for name in ("psaw", "etf"):  # no density budget: their depth schedule, the paper's dense layers
        assert create_backend(name, cfg).config.dense_layers == (0, 1)


def test_forced_units_beyond_the_budget_are_refused(model):
    """A request whose forced units alone attend more than the target is refused (one line, the least density
    that fits), for its prefill and for its decode; just above that least density the request runs and its
    prefill does not overshoot."""
    net, seed = model
    sw = create_backend("sketch_walk", net.cfg, density=0.3, dense_layers=DENSE, block_size=B)
    with pytest.raises(ValueError, match="forced units alone attend in the prefill of 100 tokens") as e:
        sw.check_request(100, 110)
    assert "\n" not in str(e.value)
    cis = create_backend("cis", net.cfg, density=0.3, dense_layers=DENSE)  # 16 sink + 64 local keys, always
    with pytest.raises(ValueError, match="in the decode of"):
        cis.check_request(300, 310)  # 80 forced keys of 301 at 0.067 per sparse layer
    cis.check_request(2000, 2010)  # 0.067 per sparse layer of 2001 keys is 133: the 80 forced ones fit
    # SOCKET's sink and local tokens shrink to a budget they exceed: its decode always meets the density
    socket = create_backend("socket", net.cfg, density=0.3, dense_layers=DENSE, sink_tokens=64, local_tokens=64)
    socket.check_request(300, 310)  # 128 forced keys of 301 at 0.067 per sparse layer: they shrink to 10 of 20
    assert sum(socket.budget(301)) == host_row_budget(socket.layer_density, 301) == 20
    n = 1200
    floor = prefill_floor(n, 2, B)  # Quest: the sink block and the diagonal
    least = (1 + floor * (LAYERS - 1)) / LAYERS
    quest = create_backend("quest", net.cfg, density=least * 0.99, dense_layers=DENSE, block_size=B)
    with pytest.raises(ValueError, match=f"at least {least:.4f}"):
        quest.check_request(n, n + 1)
    quest = create_backend("quest", net.cfg, density=least * 1.01, dense_layers=DENSE, block_size=B)
    quest.check_request(n, n + 1)
    _, prefill, _ = _measure(net, quest, n, 1, torch.Generator().manual_seed(seed))
    assert prefill == pytest.approx(least * 1.01, abs=0.01), f"seed {seed}"


def test_prefill_block_budget_pays_back_the_forced_excess():
    """The first rows keep their forced blocks above their share; the running total then returns to the target,
    so a whole prefill's blocks are the target's (the table is cumulative and exact, not per row)."""
    d, forced, rows = 0.1, 2, 64
    k = prefill_block_budget(d, torch.arange(rows), rows - 1, forced, 64).tolist()
    assert k[:2] == [1, 2] and all(c >= min(i + 1, forced) for i, c in enumerate(k))
    h = (64 + 1) / 128
    attended = sum(c - 1 + h for c in k)
    causal = rows * (rows - 1) / 2 + rows * h
    assert attended / causal == pytest.approx(d, abs=0.5 / causal)  # within half a block of the whole prefill


def test_grpc_final_message_carries_both_densities_and_cached_tokens():
    from raysparse.generate import FinishEvent
    from raysparse.serving.servicer import RaySparseServicer

    servicer = RaySparseServicer(engine=None)
    fin = FinishEvent("r1", "length", (1, 2), "ab", 5, 0.1, 0.2,
                      stats={"density": {"prefill": 0.25, "decode": 0.5}, "cached_tokens": 3, "replica": 0})
    msg = servicer._finish(fin, "quest", 0.3).finish
    assert msg.density.prefill == 0.25 and msg.density.decode == 0.5 and msg.cached_tokens == 3
    # a phase without metered steps stays unset; no cached_tokens in the event is 0
    fin = FinishEvent("r2", "length", (1,), "a", 5, 0.1, 0.0, stats={"density": {"prefill": 0.25, "decode": None}})
    msg = servicer._finish(fin, "quest", 0.3).finish
    assert msg.density.HasField("prefill") and not msg.density.HasField("decode") and msg.cached_tokens == 0


def test_bench_metrics_report_prefill_and_decode_density():
    from raysparse.bench.metrics import RequestRecord, compute_metrics

    recs = [RequestRecord(10, 0.0, [0.1, 0.2], 2, 0.3, True, "", 0.2, 0.3),
            RequestRecord(10, 0.0, [0.1, 0.2], 2, 0.3, True, "", 0.4, None),
            RequestRecord(10, 0.0, [], 0, 0.3, False, "x", 0.9, 0.9)]  # failed: not counted
    out = compute_metrics(recs, 1.0)
    assert out["mean_density_prefill"] == pytest.approx(0.3) and out["mean_density_decode"] == pytest.approx(0.3)
    assert compute_metrics(recs[2:], 1.0)["mean_density_prefill"] is None
