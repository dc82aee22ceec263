"""The engine's replicas: where each group of shards goes, how many threads a CPU shard takes, and the
replicas' runners built from the engine's config.

Each group is pinned to one node, the groups spread over the nodes (``replica.choose_node``: the node with
room and the fewest replicas so far); with ``placement`` "current" every group takes the bundles of the
placement group this process runs in (a Ray Serve replica's) instead. Nothing here starts a shard: the
engine starts the groups once they are all built.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from raysparse.actors.shard_worker import ShardSpec
from raysparse.orchestration.engine_config import EngineConfig
from raysparse.orchestration.replica import ReplicaGroup, choose_node
from raysparse.orchestration.runner import ReplicaRunner
from raysparse.orchestration.scheduler import Scheduler, SchedulerConfig


def shard_threads(cfg: EngineConfig, use_gpu: bool, local: bool) -> int | None:
    """Torch threads of each CPU shard. On a local instance this process started (``local``: the engine's
    own, or the server's in front of it), its shards are all there is, so they split its cores (a TP=1 engine
    takes them all; the draft actor runs between the verifier's steps). On a cluster a shard cannot know its
    node's other tenants: None keeps the worker's own default, half its node's cores."""
    if use_gpu or not local:
        return None
    cores = cfg.num_cpus or os.cpu_count() or 1
    return max(1, cores // (cfg.tp * cfg.replicas))


def current_placement_group(cfg: EngineConfig) -> Any:
    """The placement group this process runs in when ``placement`` is "current" (else None)."""
    if cfg.placement != "current":
        return None
    from ray.util import get_current_placement_group

    pg = get_current_placement_group()
    if pg is None:
        raise RuntimeError("placement 'current' needs a process inside a placement group (a Serve replica "
                           "with placement_group_bundles)")
    if len(pg.bundle_specs) < 1 + cfg.tp:
        raise RuntimeError(f"the placement group has {len(pg.bundle_specs)} bundles; tp={cfg.tp} needs "
                           f"1 + {cfg.tp}")
    return pg


def replica_runners(cfg: EngineConfig, spec: ShardSpec, use_gpu: bool, tokenizer: Any,
                    prefix: str) -> Iterator[ReplicaRunner]:
    """The ``cfg.replicas`` runners, one at a time as each is built (none started), so that the engine holds
    every runner built before one that fails and stops them. ``prefix`` names the groups' actors."""
    load: dict[str, int] = {}
    current = current_placement_group(cfg)
    for i in range(cfg.replicas):
        node = None if current is not None else choose_node(cfg.tp, use_gpu, cfg.cpus_per_shard, load)
        if node is not None:
            load[node] = load.get(node, 0) + 1
        group = ReplicaGroup(i, spec, cfg.tp, use_gpu, cfg.cpus_per_shard, node, prefix=prefix,
                             placement_group=current, first_bundle=1 if current is not None else 0)
        pages = -(-cfg.kv_cache_tokens // cfg.page_size)
        sched = Scheduler(SchedulerConfig(pages, cfg.page_size, cfg.max_batch, cfg.prefill_chunk(use_gpu),
                                          cfg.max_waiting, cfg.decode_steps_for(use_gpu), cfg.prefix_cache,
                                          idle_prefill_tokens=cfg.idle_prefill(use_gpu),
                                          device_pages=cfg.device_pages(),
                                          pinned_pages=cfg.kv_offload.pinned_pages if cfg.kv_offload else 0))
        yield ReplicaRunner(i, group, sched, tokenizer, liveness_s=cfg.liveness_s)
