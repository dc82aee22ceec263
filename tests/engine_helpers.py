"""Shared by the engine tests: run requests one at a time, and compare shards' selections with TP=1's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from raysparse.orchestration.engine import Engine, EngineConfig, EngineRequest
from raysparse.sampling import SamplingParams

# Methods that make one selection per layer and expand it over the KV heads (Sketch&Walk's walk, the
# positional baselines), so every shard must hold exactly TP=1's list.
SHARED_SELECTION = ("sketch_walk", "streaming", "psaw", "etf")


def run(engine: Engine, method: str, params: dict[str, Any], ps: list[tuple[int, ...]],
        new: int = 6) -> list[tuple[int, ...]]:
    out = []
    for p in ps:  # one at a time: identical batches on both engines, so identical traces
        fin = engine.submit(EngineRequest(p, SamplingParams(max_new_tokens=new, ignore_eos=True), method,
                                          params)).result(300)
        assert fin.finish_reason == "length", fin.error
        out.append(fin.token_ids)
    return out


def on_shards(engine: Engine, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """``fn(executor, *args)`` on every shard of replica 0, in rank order, through Ray's ``__ray_call__`` (the
    test hooks are the executor's, not actor methods). ``fn`` is pickled by value, so it must be a lambda that
    names nothing of this module: the workers cannot import it."""
    return engine.runners[0].group.call("__ray_call__", lambda worker, *a: fn(worker.local_executor(), *a), *args)


def record_selections(engine: Engine, key: str) -> None:
    """From now on every shard keeps every sparse selection of ``key``'s backend (``assert_same_selections``)."""
    on_shards(engine, lambda ex, k: ex.record_selections(k), key)


def kill_shard_mid_request(engine: Engine, prompt: tuple[int, ...], tokens_first: int = 1, new: int = 200) -> str:
    """Kills rank 1 of replica 0 while a long request decodes (after ``tokens_first`` tokens); checks the
    request fails naming the dead shard and the group comes back rebuilt once. Returns the victim's name."""
    import time

    import ray

    h = engine.submit(EngineRequest(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True)))
    for _ in range(tokens_first):
        h.get(60)
    victim = engine.server_info()["replicas"][0]["shards"][1]["name"]
    ray.kill(ray.get_actor(victim))
    fin = h.result(120)
    assert fin.finish_reason == "error" and "died" in fin.error and victim in fin.error
    deadline = time.time() + 240
    while engine.server_info()["replicas"][0]["state"] != "ready" and time.time() < deadline:
        time.sleep(0.5)
    rep = engine.server_info()["replicas"][0]
    assert rep["state"] == "ready" and rep["rebuilds"] == 1
    assert victim not in [s["name"] for s in rep["shards"]]
    return victim


def assert_same_selections(e1: Engine, e2: Engine, shared: bool) -> None:
    """Shards of e2 (TP=2) against e1 (TP=1), call by call: the same list on every shard when the method
    shares one selection across heads, else the shards' heads in rank order are TP=1's heads."""
    (one,) = on_shards(e1, lambda ex: getattr(ex, "selections", []))
    shards = on_shards(e2, lambda ex: getattr(ex, "selections", []))
    assert len(one) > 0 and all(len(s) == len(one) for s in shards)
    heads = [info["kv_heads"] for info in e2.runners[0].group.info]
    for i, (layer, _, full) in enumerate(one):
        parts = [s[i][2] for s in shards]
        assert all(s[i][0] == layer for s in shards)
        if shared:
            for p in parts:
                assert torch.equal(p[0], full[0]), f"shards disagree with TP=1 at layer {layer}"
        else:
            assert [p.shape[0] for p in parts] == heads
            width = max(p.shape[-1] for p in parts + [full])
            pad = [torch.nn.functional.pad(p, (0, width - p.shape[-1]), value=-1) for p in parts]
            full = torch.nn.functional.pad(full, (0, width - full.shape[-1]), value=-1)
            assert torch.equal(torch.cat(pad), full), f"selections differ at layer {layer}"


def tp1_and_tp2(tp2: dict[str, Any] | None = None, **common: Any) -> Iterator[tuple[Engine, Engine]]:
    """A TP=1 and a TP=2 engine on one local Ray instance (a module fixture's body); stops what it started.
    ``tp2``: settings of the TP=2 engine alone (e.g. multi-step decode, checked against TP=1's single steps)."""
    import ray

    from raysparse.orchestration.ray_env import start_ray

    owns = start_ray(None, num_cpus=4)
    e1 = Engine(EngineConfig(tp=1, **common)).start()
    e2 = Engine(EngineConfig(tp=2, **{**common, **(tp2 or {})})).start()
    try:
        yield e1, e2
    finally:
        e1.shutdown()
        e2.shutdown()
        if owns:
            ray.shutdown()
