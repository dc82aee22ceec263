"""The shard worker actor: one tensor-parallel shard per GPU (or per CPU process), its KV cache and metadata.

Life cycle, driven by ``orchestration.replica.ReplicaGroup``: ``node_info`` (the group orders ranks by
Ray node id), ``rendezvous`` on rank 0 (a free port on its node), ``setup`` on every rank (joins the
group's torch.distributed process group: NCCL on GPUs, gloo on CPU; reads only its own slices of the
weights, ``shard_load.load_model_shard``, reporting the bytes read and the peak host memory as ``load``; sizes
the cache), then ``execute`` once per engine step with the same plan on every rank. Tests, benchmarks
and the distributed eval reach the executor through Ray's ``__ray_call__`` (``local_executor``) rather than
through actor methods of their own.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray
import torch

from raysparse.config import parse_dtype
from raysparse.kv_cache import KVCache
from raysparse.kv_tiers import KVOffloadConfig
from raysparse.layers import merge_projections
from raysparse.runtime_config import RuntimeConfig
from raysparse.shard_executor import ShardExecutor
from raysparse.step_plan import StepPlan

log = logging.getLogger("raysparse.shard")


@dataclass(frozen=True)
class ShardSpec:
    """What every shard of a group loads. ``random_weights``: the config only, weights drawn from
    ``seed`` (the same on every rank, so the shards slice one model) - for speed runs of big models.
    ``runtime``: which kernels and collectives the shard runs (``EngineConfig.runtime``); ``kv_offload``: the
    K/V tiers' sizes (``EngineConfig.kv_offload``)."""

    model: str | None = None
    dtype: str = "float32"
    kv_cache_tokens: int = 16384
    page_size: int = 64
    random_weights: bool = False
    seed: int = 0
    num_threads: int | None = None
    collective_timeout_s: float = 300.0
    cuda_graphs: bool = True
    max_batch: int = 64  # the largest decode batch a captured graph must hold
    runtime: RuntimeConfig = RuntimeConfig()
    kv_offload: KVOffloadConfig | None = None  # the K/V tiers (``--kv-offload``); None: one tier

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        if self.kv_cache_tokens <= 0 or self.page_size <= 0 or self.max_batch <= 0:
            raise ValueError("kv_cache_tokens, page_size and max_batch must be positive")


def local_gpu_index() -> int:
    """The CUDA index of the GPU Ray assigned to this actor. The group starts its GPU actors with every GPU
    of the node visible (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``), because the symmetric-memory
    all-reduce maps the peers' memory and tells ranks apart by device; where Ray narrowed the visible set
    to the one GPU anyway, that GPU is index 0."""
    if os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES") and "CUDA_VISIBLE_DEVICES" not in os.environ:
        # all of them, spelled out: Ray's compiled-graph channels look the assigned GPU up in this list
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(torch.cuda.device_count()))
    try:
        import ray

        ids = [str(i) for i in ray.get_gpu_ids()]
    except Exception:  # noqa: BLE001 - not inside a Ray worker
        ids = []
    if not ids:
        return torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return int(ids[0])
    names = [v.strip() for v in visible.split(",")]
    return names.index(ids[0]) if ids[0] in names else 0


# Every torch computation of the shard (setup, steps, ``__ray_call__`` work) runs on the actor's default
# group, one thread; liveness and statistics run on the "control" group's thread, beside a step. On a CPU
# shard, computations spread over two threads start two OpenMP teams, and the idle team's workers take the
# cores from the running one: the sparse methods' decode steps cost up to 1.6x more that way, dense's 1.2x.
CONTROL_GROUP = "control"
CONCURRENCY_GROUPS = {CONTROL_GROUP: 1}


class ShardWorker:
    def __init__(self, spec: ShardSpec) -> None:
        self.spec = spec
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        # Ray runs the methods of this (threaded) actor on a pool of threads, and the current CUDA device is
        # per thread: every entry point sets it (``local_executor``, ``setup``).
        self.gpu_index = local_gpu_index() if self.device == "cuda" else None
        if self.device == "cpu":
            torch.set_num_threads(spec.num_threads or max(1, (os.cpu_count() or 2) // 2))
        self.executor: ShardExecutor | None = None

    @ray.method(concurrency_group=CONTROL_GROUP)
    def node_info(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "device": self.device, "gpu_ids": ray.get_gpu_ids(), "cuda_index": self.gpu_index}

    def rendezvous(self) -> tuple[str, int]:
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def setup(self, rank: int, world_size: int, master: tuple[str, int]) -> dict[str, Any]:
        import torch.distributed as dist

        from raysparse.all_reduce import make_all_reduce, make_reduce_norm
        from raysparse.checkpoint import LoadStats
        from raysparse.config import ModelConfig
        from raysparse.loader import build_model, load_hf_config, materialize, resolve_source
        from raysparse.shard_load import load_model_shard
        from raysparse.tensor_parallel import connect_group, shard_layers

        spec, dtype = self.spec, parse_dtype(self.spec.dtype)
        self._use_gpu()
        if world_size > 1:
            backend = "nccl" if self.device == "cuda" else "gloo"
            # A bounded timeout: a rank blocked on a dead peer gives up instead of hanging for 30 minutes.
            device_id = torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else None
            dist.init_process_group(backend, init_method=f"tcp://{master[0]}:{master[1]}", rank=rank,
                                    world_size=world_size, timeout=timedelta(seconds=spec.collective_timeout_s),
                                    device_id=device_id)
        src = resolve_source(spec.model)
        if src.gguf_file is not None:
            src = materialize(src)
        hf_config = load_hf_config(src)
        cfg = ModelConfig.from_hf(hf_config)
        rt = spec.runtime
        reduce, reduce_path = (make_all_reduce(self.device, dtype, cfg.hidden_size, mode=rt.allreduce)
                               if world_size > 1 else (None, "none"))
        reduce_norm = make_reduce_norm(reduce, reduce_path, self.device, dtype, cfg.hidden_size,
                                       max_rows=max(spec.max_batch, 64), enabled=rt.fused_allreduce,
                                       fused_ops=rt.fused_ops) if reduce is not None else None
        if spec.random_weights:  # the same seed on every rank: each keeps its slices of one model
            torch.manual_seed(spec.seed)
            model = shard_layers(build_model(hf_config, dtype=dtype, device=self.device), rank, world_size)
            if world_size > 1:
                merge_projections(model)
            load = LoadStats("random", rank, world_size, 0, 0, 0, 0, 0, 0, False, 0.0)
        else:  # only this rank's slices of the checkpoint are read (safetensors)
            model, load = load_model_shard(src, rank, world_size, dtype=dtype, device=self.device,
                                           hf_config=hf_config)
        log.info("shard %d/%d of %s: %s", rank, world_size, src.name, load.summary())
        connect_group(model, reduce=reduce, reduce_norm=reduce_norm)
        pages = -(-spec.kv_cache_tokens // spec.page_size)
        # with the tiers: on a GPU the tiered layers' pages are allocated in pinned host memory, never on the device
        cache = KVCache(model.cfg, pages, spec.page_size, dtype, self.device, model.num_kv_heads,
                        offload=spec.kv_offload)
        sync = torch.cuda.synchronize if self.device == "cuda" else None
        graphs = None
        # the tier's fetch="pages" reads each layer's selection on the host: those steps run eagerly
        if self.device == "cuda" and spec.cuda_graphs and (spec.kv_offload is None or spec.kv_offload.fetch == "rows"):
            from raysparse.decode_graphs import DecodeGraphs

            graphs = DecodeGraphs(model, cache, spec.max_batch)
        self.executor = ShardExecutor(model, cache, rank, world_size, reduce, sync, graphs, rt,
                                      offload=spec.kv_offload)
        return {"rank": rank, "kv_heads": model.num_kv_heads, "kv_offset": getattr(model, "kv_head_offset", 0),
                "kv_pages": pages, "page_size": spec.page_size, "device": self.device,
                "all_reduce": reduce_path + ("+norm" if reduce_norm is not None else ""), "load": load.as_dict()}

    def _use_gpu(self) -> None:
        if self.gpu_index is not None:
            torch.cuda.set_device(self.gpu_index)

    def local_executor(self) -> ShardExecutor:
        """The executor, with this thread's CUDA device set (what a ``__ray_call__`` function should use)."""
        if self.executor is None:
            raise RuntimeError("shard worker: setup first")
        self._use_gpu()
        return self.executor

    def execute(self, plan: StepPlan) -> dict[str, Any]:
        return self.local_executor().execute(plan)

    def verify(self, plan: StepPlan, message: bytes) -> dict[str, Any]:
        return self.local_executor().verify(plan, message)

    def export_kv(self, ranges: list[tuple[int, int, int]]) -> dict[int, tuple[Any, Any, str]]:
        """ranges: (seq id, start, end) -> this shard's K/V of those positions (``kv_transfer.export_tokens``, as
        ``to_arrays``), for the SpecAttn draft actor that shares this shard's device (``DraftWorker.adopt_prefill``,
        ``DraftWorker.propose``)."""
        from raysparse.kv_transfer import export_tokens, to_arrays

        cache = self.local_executor().cache
        return {sid: to_arrays(*export_tokens(cache, sid, start, end)) for sid, start, end in ranges}

    @ray.method(concurrency_group=CONTROL_GROUP)
    def stats(self, reset: bool = False) -> dict[str, Any]:
        return self.local_executor().stats(reset)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def ping(self) -> bool:
        return True
