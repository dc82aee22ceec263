"""Which Sketch&Walk instances decode from CUDA graphs: ``attach_graph_decode`` gives a backend the graph
path its scoring has (``sketch_walk_graph`` for SPEC's head mean, ``sketch_walk_graph_paired`` for the
paired scorings), with its fixed-shape state, or leaves it on the eager decode (and says so in the log). A shard
reaches it through ``SketchWalk.bind`` when it has a graph runner."""

from __future__ import annotations

import logging
from typing import Any

import torch

from raysparse.kv_cache import KVCache
from raysparse.methods.sketch_walk import SketchWalk
from raysparse.methods.sketch_walk_graph import SketchWalkGraphDecode
from raysparse.runtime_config import RuntimeConfig

log = logging.getLogger(__name__)


def attach_graph_decode(backend: Any, cache: KVCache, max_batch: int, state_budget_bytes: int = 8 << 30,
                        max_positions: int | None = None, runtime: RuntimeConfig | None = None) -> bool:
    """Gives a backend that has a graph path its fixed-shape state; returns whether it now has one.
    ``runtime`` (default: ``RuntimeConfig()``) picks the path's kernels. The paired scorings
    (``sketch_walk_graph_paired``) get theirs unless ``runtime.sw_graph_paired`` is False: one page-indexed
    allocation, sized by the cache's pages (not by batch or positions), within the budget, and shared by every
    instance with the same sketch, parts and sparse layers (``PairedGraphDecode.state_key``)."""
    if not isinstance(backend, SketchWalk) or cache.page_size != backend.config.block_size:
        return False
    runtime = runtime or RuntimeConfig()
    if backend.config.heads != "mean":
        from raysparse.methods.sketch_walk_graph_paired import PairedGraphDecode

        if not runtime.sw_graph_paired or not PairedGraphDecode.supports(backend.config):
            return False
        shared = PairedGraphDecode.state_key(backend) in cache.shared_state  # no new allocation
        need = 0 if shared else PairedGraphDecode.state_bytes(backend, cache.num_pages, cache.num_kv_heads)
        if need > state_budget_bytes:
            return _over_budget(need, state_budget_bytes)
        return _attach(backend, lambda: PairedGraphDecode(backend, cache, runtime), need)
    limit = cache.num_pages if max_positions is None else min(cache.num_pages, -(-max_positions // cache.page_size))
    need = (max_batch + 1) * SketchWalkGraphDecode.state_bytes(backend, limit)
    if need > state_budget_bytes:
        return _over_budget(need, state_budget_bytes)
    return _attach(backend, lambda: SketchWalkGraphDecode(backend, cache, max_batch, limit, runtime), need)


def _over_budget(need: int, budget: int) -> bool:
    log.warning("sketch_walk: the graph decode's state (%.2f GB) exceeds its budget (%.2f GB): decoding eagerly, "
                "much slower", need / 2**30, budget / 2**30)
    return False


def _attach(backend: SketchWalk, build: Any, need: int) -> bool:
    # The state is allocated when a method is first used, after the KV cache took its memory: where the device
    # has no room left, the method decodes eagerly rather than failing the request that asked for it.
    try:
        backend.graph_path = build()
    except torch.OutOfMemoryError:
        log.warning("sketch_walk: no device memory left for the graph decode's state (%.2f GB): decoding eagerly, "
                    "much slower; a smaller KV cache (--kv-cache-tokens) leaves room for it", need / 2**30)
        return False
    return True
