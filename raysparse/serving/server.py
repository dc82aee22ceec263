"""The gRPC server: the RaySparse service, grpc.health.v1, reflection and the Prometheus endpoint.

The port opens before the engine loads, so orchestrators see the server at once and its health as
NOT_SERVING until every replica is ready. A poller thread mirrors ``Engine.serving()`` into the health
service (NOT_SERVING while loading, while the only replicas are rebuilding after a lost shard, and while
draining) and refreshes the KV and density gauges. ``stop`` drains: health goes NOT_SERVING and keeps
answering so for ``grace_s`` seconds while new calls are refused (UNAVAILABLE) and the streams in flight go
on; then the port closes, what is still running is cancelled, and the engine shuts down.

Health checks (``Check`` and ``Watch``) and the control calls (``Abort``, ``GetModelInfo``,
``GetServerInfo``) run on a small thread pool of their own, apart from the ``max_workers`` threads that
streams hold while they wait for tokens, so they are answered at once under any number of open streams.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from raysparse.serving.engine_metrics import EngineMetrics
from raysparse.serving.metrics import ServerMetrics
from raysparse.serving.proto import raysparse_pb2 as pb
from raysparse.serving.servicer import RaySparseServicer, add_to_server, on_pool

log = logging.getLogger("raysparse.serving")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["RaySparse"].full_name  # raysparse.v1.RaySparse


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port (see InferenceServer.port)
    metrics_port: int | None = 9400  # None: no Prometheus endpoint; 0: any free port
    max_workers: int = 256  # concurrent calls; each stream holds one thread while it waits for tokens
    poll_s: float = 0.2  # health and gauge refresh
    density_poll_s: float = 5.0  # density gauges (one call to every replica's rank-0 shard)
    grace_s: float = 5.0  # draining: health answers NOT_SERVING this long, and streams in flight go on
    control_workers: int = 4  # threads of health checks and the control calls
    http_port: int | None = None  # the OpenAI-compatible HTTP API (openai_api); None: none; 0: any free port
    served_model_name: str = ""  # the model's name in the HTTP API and the metrics ("": the engine's)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if (self.max_workers < 1 or self.control_workers < 1 or self.poll_s <= 0 or self.density_poll_s <= 0
                or not self.grace_s >= 0):
            raise ValueError("max_workers >= 1, control_workers >= 1, poll_s > 0, density_poll_s > 0 and grace_s >= 0 "
                             "are required")


class InferenceServer:
    """Serves ``engine`` (started or not: ``start_engine`` loads it while the port already answers)."""

    def __init__(self, engine: Any, cfg: ServerConfig = ServerConfig()) -> None:
        self.engine, self.cfg = engine, cfg
        self.metrics = ServerMetrics()
        self.servicer = RaySparseServicer(engine, self.metrics)
        # vLLM-named metrics of every request the engine serves, on the same /metrics
        self.engine_metrics = EngineMetrics(engine, self.metrics.registry,
                                            lambda: cfg.served_model_name or getattr(engine, "source_name", ""))
        self.openai: Any = None  # http_server.OpenAIHTTPServer
        self.http_port: int | None = None
        # Health and control calls never wait behind streams for a thread (see the module docstring).
        self._control = futures.ThreadPoolExecutor(max_workers=cfg.control_workers,
                                                   thread_name_prefix="raysparse-control")
        self.health = health.HealthServicer(experimental_thread_pool=self._control)
        self.health.Check = on_pool(self.health.Check, self._control)  # type: ignore[method-assign]
        self._stopping = False
        self.port = 0
        self.metrics_port: int | None = None
        self._server: grpc.Server | None = None
        self._http: Any = None
        self._stop = threading.Event()
        self._owns_ray = False
        self._poller = threading.Thread(target=self._poll, name="raysparse-health", daemon=True)

    def start(self) -> InferenceServer:
        if self.engine.state == "created":
            # Ray forks its daemons when it starts: do it before gRPC has threads (its fork handlers then
            # stay out of the way); the engine joins this instance and the server stops it at the end.
            from raysparse.orchestration.local_job import start_ray

            self._owns_ray = start_ray(self.engine.cfg.address, self.engine.cfg.num_cpus)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.cfg.max_workers),
                             options=[("grpc.so_reuseport", 0)])
        # not the generated one: undecodable requests are INVALID_ARGUMENT, control calls run on their own pool
        add_to_server(self.servicer, server, self._control)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        self.port = server.add_insecure_port(f"{self.cfg.host}:{self.cfg.port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {self.cfg.host}:{self.cfg.port}")
        self._set_health(False)
        server.start()
        self._server = server
        if self.cfg.metrics_port is not None:
            self._http = self.metrics.serve_http(self.cfg.metrics_port, self.cfg.host)
            self.metrics_port = self._http[0].server_port
        if self.cfg.http_port is not None:
            from raysparse.serving.http_server import OpenAIHTTPServer
            from raysparse.serving.openai_frontend import OpenAIFrontend

            self.openai = OpenAIHTTPServer(OpenAIFrontend(self.engine, self.cfg.served_model_name), self.cfg.host,
                                           self.cfg.http_port, self.metrics.registry, self.cfg.grace_s).start()
            self.http_port = self.openai.port
        self._poller.start()
        return self

    def start_engine(self) -> None:
        """Loads the engine in this thread (Ray wants its driver in the main thread) if not started."""
        if self.engine.state == "created":
            self.engine.start()
        self._refresh(density=False)

    def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def _refresh(self, density: bool) -> None:
        serving = bool(self.engine.serving()) and not self._stop.is_set()
        self._set_health(serving)
        if self.engine.state in ("ready", "draining"):
            self.metrics.observe_server(self.engine.server_info())
            if density and serving:
                self.metrics.observe_density(self.engine.shard_stats())

    def _poll(self) -> None:
        since_density = 0.0
        while not self._stop.wait(self.cfg.poll_s):
            since_density += self.cfg.poll_s
            try:
                self._refresh(density=since_density >= self.cfg.density_poll_s)
            except Exception as e:  # a replica mid-rebuild may fail a stats call: try again next tick
                log.debug("health poll: %s", e)
            if since_density >= self.cfg.density_poll_s:
                since_density = 0.0

    def wait(self, timeout: float | None = None) -> bool:
        assert self._server is not None
        return self._server.wait_for_termination(timeout)

    def stop(self, shutdown_engine: bool = True) -> None:
        """Drains (see the module docstring), then stops the server and, with ``shutdown_engine``, the engine
        and the local Ray instance the server started. A second call while the first drains returns at once."""
        if self._stopping:
            return
        self._stopping = True
        self._stop.set()
        self.health.enter_graceful_shutdown()  # NOT_SERVING from here on, whatever the poller last set
        if self.openai is not None:
            self.openai.begin_stop()  # no new HTTP connections; the streams in flight drain with gRPC's
        if shutdown_engine and hasattr(self.engine, "drain"):
            self.engine.drain()  # new calls are refused; the ones in flight go on
        if self._server is not None:
            # The port stays open for the grace period, so health checks get their NOT_SERVING answer
            # rather than a refused connection; then what still runs is cancelled.
            time.sleep(self.cfg.grace_s)
            self._server.stop(0).wait(10)
            self._server = None
        if self.openai is not None:
            self.openai.stop()
            self.openai = None
        self._control.shutdown(wait=False, cancel_futures=True)
        if self._poller.is_alive():
            self._poller.join(timeout=5)
        if self._http is not None:
            self._http[0].shutdown()
            self._http[0].server_close()
            self._http = None
        if shutdown_engine:
            self.engine.shutdown()
            if self._owns_ray:
                from raysparse.orchestration.ray_env import stop_ray

                stop_ray()
                self._owns_ray = False
