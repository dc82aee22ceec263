"""Scaling over replicas: one engine (and its gRPC server) per replica count, replicas spread over a Ray
cluster's nodes, the same prompts each time; reports throughput, latency and scaling efficiency.

``local_cluster`` makes a multi-node cluster on one host with ``ray.cluster_utils.Cluster`` (each node its own
raylet with its own node id, so placement treats them as separate machines) for tests and demos.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from raysparse.bench.loadgen import LoadConfig, run_load
from raysparse.orchestration.engine_config import EngineConfig

log = logging.getLogger("raysparse.bench")


@contextlib.contextmanager
def local_cluster(nodes: int, cpus_per_node: float = 1, dashboard: bool = False) -> Iterator[str]:
    """A ``nodes``-node Ray cluster on this host (head included); yields its address, stops it after."""
    import os

    from ray.cluster_utils import Cluster

    from raysparse.orchestration.local_job import LOCAL_RAY_ENV

    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    for k, v in LOCAL_RAY_ENV.items():
        os.environ.setdefault(k, v)
    # each node's agent takes its own free port (the default, 52365, is one per host)
    head: dict[str, Any] = {"num_cpus": cpus_per_node, "include_dashboard": dashboard,
                            "dashboard_agent_listen_port": free_port()}
    if dashboard:
        head["dashboard_host"] = "127.0.0.1"
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=cpus_per_node, dashboard_agent_listen_port=free_port())
        cluster.wait_for_nodes(timeout=120)
        yield cluster.address
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nodes_used(server_info: dict[str, Any]) -> int:
    return len({s["node_id"] for r in server_info["replicas"] for s in r["shards"]})


def run_scaling(engine_cfg: EngineConfig, replica_counts: Sequence[int], prompts: Sequence[Sequence[int]],
                load: LoadConfig, slos_ms: dict[str, float] | None = None, host: str = "127.0.0.1",
                on_step: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """One row per replica count: the bench metrics, the nodes the replicas landed on, and the efficiency
    (throughput over replica count times the throughput of the first row per replica)."""
    from raysparse.orchestration.engine import Engine
    from raysparse.serving.client import RaySparseClient
    from raysparse.serving.server import InferenceServer, ServerConfig

    rows: list[dict[str, Any]] = []
    for n in replica_counts:
        eng = Engine(replace(engine_cfg, replicas=n))
        srv = InferenceServer(eng, ServerConfig(host=host, port=0, metrics_port=None)).start()
        try:
            srv.start_engine()
            target = f"{host}:{srv.port}"
            with RaySparseClient(target) as c:
                c.wait_serving(120)
            metrics, _ = run_load(target, prompts, load, slos_ms)
            row = {"replicas": n, "nodes": nodes_used(eng.server_info()), "prompt_len": len(prompts[0]),
                   **metrics}
        finally:
            srv.stop()
        per_replica = rows[0]["output_throughput"] / rows[0]["replicas"] if rows else row["output_throughput"] / n
        row["scaling_efficiency"] = row["output_throughput"] / (n * per_replica) if per_replica > 0 else 0.0
        rows.append(row)
        if on_step is not None:
            on_step(row)
    return rows
