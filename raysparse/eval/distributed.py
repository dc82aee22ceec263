"""``raysparse eval`` on the engine's shard actors: ``--tp`` shards per replica, ``--replicas``, ``--address``.

The engine starts the replicas as for serving (``Engine.start``: Ray joined or started locally, one
placement group of ``tp`` ``ShardWorker`` actors per replica, weights sharded by KV groups). The driver
builds the tasks and windows once, then every shard of every replica builds a ``Harness`` over its own
shard of the model (``_shard_setup``, through the actors' ``__ray_call__``). Each work item of a setting
(``items.py``: a task sample or a window) runs on every shard of one replica at once, the same code as the
one-process harness: the model's all-reduces keep the shards in lockstep, every rank holds the full
logits, and Sketch&Walk's walk gets the group's all-reduce as in the engine (``attach_group``).

What needs attention from inside the model runs across shards too: each shard's fidelity tracer, density
meter, SpecAttn KV reads and CIS retrievals cover its own KV heads, so an item's sums are the sum over its
shards (``items.combine_shards``); SpecAttn's draft runs on the sharded model and its layer map is
measured with the similarities summed over the shards (``specattn.map_measure``). With ``--replicas M``
the items of a setting are spread over the replicas (the next free replica takes the next item) and merged
in item order, so the JSON is the same whatever M; items after a known failure are not run.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from raysparse.eval.config import EvalConfig, Workload
from raysparse.eval.harness import Harness, eval_settings, max_total_tokens
from raysparse.eval.items import ItemResult, combine_shards, item_order, merge_items
from raysparse.eval.report import build_report
from raysparse.eval.settings import Setting
from raysparse.orchestration.spread import spread_over_replicas

_SHARDS: dict[int, tuple[Harness, Workload]] = {}  # per shard actor process: its harness and the work


@dataclass(frozen=True)
class ClusterOptions:
    tp: int = 1
    replicas: int = 1
    address: str | None = None  # an existing Ray cluster; None: a local instance started in this process
    cpus_per_shard: float = 1.0
    device: str = "cpu"  # "cpu", "cuda" or "auto" (GPUs when the cluster has tp of them)
    threads: int | None = None  # torch threads per shard; None: the local cores shared out (or Ray's default)

    def __post_init__(self) -> None:
        if self.tp < 1 or self.replicas < 1:
            raise ValueError(f"--tp and --replicas must be positive, got {self.tp} and {self.replicas}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device takes auto, cpu or cuda (each shard gets its own GPU), got {self.device!r}")
        if not self.cpus_per_shard > 0:
            raise ValueError(f"--cpus-per-shard must be > 0, got {self.cpus_per_shard}")

    def shard_threads(self) -> int | None:
        if self.threads is not None or self.address is not None:
            return self.threads
        return max(1, (os.cpu_count() or 1) // (self.tp * self.replicas))


def check_tp(model: str | None, tp: int) -> tuple[str, str]:
    """(the model directory (a GGUF converted once), the model's name); raises ValueError when ``tp`` exceeds
    its KV heads."""
    from raysparse.config import ModelConfig
    from raysparse.loader import load_hf_config, materialize, resolve_source

    src = resolve_source(model)
    name, src = src.name, materialize(src)
    kv = ModelConfig.from_hf(load_hf_config(src)).num_kv_heads
    if tp > kv:
        raise ValueError(f"--tp {tp} exceeds the model's {kv} KV heads (shards split whole KV heads)")
    return str(src.directory), name


@contextmanager
def running_engine(model_dir: str, dtype: str, opts: ClusterOptions) -> Iterator[Any]:
    """An engine whose shards only serve the harness (no draft actor, no CUDA graphs, a one-page cache),
    shut down on exit with the local Ray instance it started."""
    import math

    from raysparse.orchestration.engine import Engine, EngineConfig
    from raysparse.orchestration.ray_env import start_ray, stop_ray
    from raysparse.orchestration.signals import Signalled, StopOnSignals

    shards = opts.tp * opts.replicas
    num_cpus = None if opts.address is not None else max(os.cpu_count() or 1,
                                                         math.ceil(shards * opts.cpus_per_shard))
    stop = StopOnSignals()  # SIGTERM, SIGINT, SIGHUP: Signalled, and the clean-up below runs whole
    try:
        # Ray leaves CUDA_VISIBLE_DEVICES alone for an actor without GPUs, and a shard takes a GPU it can see:
        # --device cpu hides them, so CPU shards on a GPU node really run on the CPU.
        owns = start_ray(opts.address, num_cpus, {"CUDA_VISIBLE_DEVICES": ""} if opts.device == "cpu" else None)
        cfg = EngineConfig(model=model_dir, dtype=dtype, tp=opts.tp, replicas=opts.replicas, address=opts.address,
                           device=opts.device, kv_cache_tokens=64, max_batch=1, cpus_per_shard=opts.cpus_per_shard,
                           num_cpus=num_cpus, draft=False, cuda_graphs=False)
        engine = Engine(cfg)
        try:
            yield engine.start()
        finally:
            stop.cleaning = True  # a signal from here on is noted, not raised
            try:
                engine.shutdown()
            finally:
                if owns:
                    stop_ray()
        if stop.signum:  # a signal during the clean-up
            raise Signalled(stop.signum)
    finally:
        stop.restore()


# ---- shard side (run inside each ShardWorker through __ray_call__) ---------------------------------------
def _sum_all_reduce(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def _shard_factory(world_size: int) -> Callable[..., Any]:
    from raysparse.methods.registry import create_backend
    from raysparse.shard_executor import attach_group

    def make(name: str, model_cfg: Any, **params: Any) -> Any:
        backend = create_backend(name, model_cfg, **params)
        if world_size > 1:  # what a method agrees on across shards (Sketch&Walk's block sums), as in the engine
            attach_group(backend, _sum_all_reduce)
        return backend

    return make


def _shard_setup(worker: Any, cfg: EvalConfig, work: Workload, model_dir: str, threads: int | None) -> dict[str, Any]:
    from raysparse.loader import load_tokenizer, resolve_source

    if threads is not None:
        torch.set_num_threads(threads)
    ex = worker.executor
    harness = Harness(ex.model, load_tokenizer(resolve_source(model_dir)), cfg, _shard_factory(ex.world_size),
                      model_dir)
    _SHARDS[id(worker)] = (harness, work)
    return {"rank": ex.rank, "device": str(harness.cache.device), "threads": torch.get_num_threads()}


def _shard_item(worker: Any, setting: Setting, kind: str, index: int) -> ItemResult:
    harness, work = _SHARDS[id(worker)]
    return harness.run_item(setting, work, kind, index)


def _shard_forget(worker: Any) -> None:
    _SHARDS.pop(id(worker), None)


# ---- driver side ---------------------------------------------------------------------------------------
def run_eval_on_engine(engine: Any, cfg: EvalConfig, text: str, source: str, model_dir: str,
                       opts: ClusterOptions, model_name: str | None = None,
                       on_setting: Callable[[str, int, int, int], None] | None = None,
                       step: Callable[[], None] = lambda: None,
                       on_result: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """``run_eval`` over a started engine's replicas; the same report, plus ``cluster``."""
    import time

    import ray

    from raysparse.methods.registry import create_backend

    t0 = time.perf_counter()
    if engine.tokenizer is None:
        raise ValueError("the model has no tokenizer; the eval's tasks need one")
    mc = engine.model_cfg
    max_total_tokens(cfg, mc.max_position_embeddings)
    work = Workload.build(cfg, engine.tokenizer, text, source)
    settings = eval_settings(cfg, mc, create_backend)
    groups = [r.group for r in engine.runners]
    work_ref = ray.put(work)
    infos = [g.call("__ray_call__", _shard_setup, cfg, work_ref, model_dir, opts.shard_threads(), timeout_s=None)
             for g in groups]
    decode = cfg.decode_ppl_tokens > 0 and bool(work.windows)
    order = item_order(len(work.tasks), len(work.windows), decode)
    runs = []
    for i, setting in enumerate(settings):
        if on_setting is not None:
            label = setting.label if setting.density is None else f"{setting.label} @ {setting.density:g}"
            on_setting(label, i, len(settings), work.units(cfg))
        items = _spread(groups, setting, order, step)
        runs.append(merge_items(setting, items, mc.num_layers, cfg.rows).to_json())
        if on_result is not None:
            on_result(runs[-1])
    for g in groups:
        g.call("__ray_call__", _shard_forget)
    info = engine.model_info()
    model_info = {"name": info["model"] if model_name is None else model_name, "layers": mc.num_layers,
                  "heads": mc.num_heads, "kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim, "dtype": info["dtype"]}
    host = {"platform": platform.platform(), "torch": torch.__version__, "threads": infos[0][0]["threads"]}
    cluster = {"tp": opts.tp, "replicas": opts.replicas, "address": opts.address,
               "nodes": len({s["node_id"] for g in groups for s in g.info})}
    return build_report(cfg, settings, work, runs, model_info, infos[0][0]["device"], host,
                        time.perf_counter() - t0, cluster)


def _spread(groups: list[Any], setting: Setting, order: list[tuple[str, int]],
            step: Callable[[], None]) -> list[ItemResult]:
    """Runs ``setting``'s items over the replicas (``orchestration.spread``: one driver thread, so Ctrl-C stops
    it at once), the next free one taking the next item; returns them in item order up to the first failure
    (the items after it are dropped by the merge, so not run)."""
    results: list[ItemResult | None] = [None] * len(order)
    end = len(order)  # one past the first failed item

    def submit(group: Any, i: int) -> list[Any]:
        kind, index = order[i]
        return group.submit("__ray_call__", _shard_item, setting, kind, index)

    def done(i: int, parts: list[ItemResult]) -> bool:
        nonlocal end
        item = results[i] = combine_shards(parts)  # rank order
        if item.error is not None:
            end = min(end, i + 1)
        step()
        return item.error is None

    spread_over_replicas(groups, len(order), submit, done)
    out = results[:end]
    assert all(r is not None for r in out), "an item before the first failure did not run"
    return out  # type: ignore[return-value]
