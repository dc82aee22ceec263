"""The engine's metrics under vLLM's names and meanings, prefixed ``raysparse:``, with a ``model_name`` label.

Dashboards and autoscalers built for vLLM read them unchanged once the prefix is swapped:

- ``raysparse:num_requests_running`` and ``raysparse:num_requests_waiting`` (gauges);
- ``raysparse:kv_cache_usage_perc``: the reserved fraction of the KV cache, 0 to 1 (1 is 100%, as vLLM's);
- ``raysparse:time_to_first_token_seconds`` (submission to the first token),
  ``raysparse:inter_token_latency_seconds`` (between two consecutive tokens of one request) and
  ``raysparse:e2e_request_latency_seconds`` (submission to the finish), histograms;
- ``raysparse:prompt_tokens_total`` and ``raysparse:generation_tokens_total`` (counters);
- ``raysparse:request_success_total`` by ``finished_reason`` (stop, length, abort, error);
- ``raysparse:prefix_cache_queries_total`` and ``raysparse:prefix_cache_hits_total``: prompt tokens of finished
  requests, and those of them taken from the prefix cache (counters, as vLLM's; the hit rate is their ratio);
- ``raysparse:attention_density``: a histogram of each finished request's measured density by ``method``
  and ``phase`` (prefill, decode), the density its own steps had (``runner.account_density``).

Every request the engine accepts is timed, whatever front end sent it (gRPC, HTTP, a job): an engine
observer attaches a listener to each request (``Engine.add_request_observer``). The gauges are read from
``Engine.server_info()`` when Prometheus scrapes. Label values come from closed sets: the served model's
name, the finish reasons, the registered methods.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from raysparse.generate import FinishEvent, TokenEvent

PREFIX = "raysparse:"
# vLLM's buckets (v1): TTFT and E2E in seconds, ITL finer
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
DENSITY_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class EngineMetrics:
    """Registers the metrics on ``registry`` and times every request ``engine`` accepts from now on.

    ``model_name``: the served name, or a callable giving it (the engine knows its model only once loaded).
    """

    def __init__(self, engine: Any, registry: CollectorRegistry | None = None,
                 model_name: str | Callable[[], str] = "") -> None:
        self.engine = engine
        self.registry = registry if registry is not None else CollectorRegistry()
        self._name = model_name
        r, m = self.registry, ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              m, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             m, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", m, buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Number of prefill tokens processed.", m, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Number of generation tokens processed.", m,
                                         registry=r)
        self.success = Counter(PREFIX + "request_success", "Count of finished requests by finished reason.",
                               m + ["finished_reason"], registry=r)
        self.prefix_queries = Counter(PREFIX + "prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.", m, registry=r)
        self.prefix_hits = Counter(PREFIX + "prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.", m, registry=r)
        self.density = Histogram(PREFIX + "attention_density",
                                 "Measured attention density of finished requests (attended / causal pairs).",
                                 m + ["method", "phase"], buckets=DENSITY_BUCKETS, registry=r)
        r.register(_EngineGauges(self))
        engine.add_request_observer(self.observe)

    @property
    def model_name(self) -> str:
        name = self._name() if callable(self._name) else self._name
        return name or getattr(self.engine, "source_name", "") or "raysparse"

    def observe(self, handle: Any) -> None:
        """Engine observer: times this request's tokens and records its finish (runs on engine threads)."""
        name = self.model_name
        t0 = time.perf_counter()
        last = [0.0]
        ttft, itl, gen = self.ttft.labels(name), self.itl.labels(name), self.generation_tokens.labels(name)
        method = handle.request.method

        def on_event(ev: Any) -> None:
            now = time.perf_counter()
            if isinstance(ev, TokenEvent):
                if last[0]:
                    itl.observe(now - last[0])
                else:
                    ttft.observe(now - t0)
                last[0] = now
                gen.inc()
            elif isinstance(ev, FinishEvent):
                self.e2e.labels(name).observe(now - t0)
                self.prompt_tokens.labels(name).inc(ev.prompt_tokens)
                self.prefix_queries.labels(name).inc(ev.prompt_tokens)
                self.prefix_hits.labels(name).inc(ev.stats.get("cached_tokens", 0))
                # a front end that ended the request itself (a stop string) says why
                reason = handle.finish_reason_hint or ev.finish_reason
                self.success.labels(name, reason if reason in FINISH_REASONS else "error").inc()
                for phase, value in (ev.stats.get("density") or {}).items():
                    if value is not None:
                        self.density.labels(name, method, phase).observe(value)

        handle.add_listener(on_event)


class _EngineGauges(Collector):
    """Running and waiting requests and KV usage, read from the engine at scrape time."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        info: dict[str, Any] = {}
        if getattr(self.m.engine, "state", "") in ("ready", "draining"):
            try:
                info = self.m.engine.server_info()
            except Exception:  # a replica being rebuilt: report zeros this time
                info = {}
        name = self.m.model_name
        cap = info.get("kv_capacity_tokens", 0)
        for metric, doc, value in (
                ("num_requests_running", "Number of requests in model execution batches.", info.get("running", 0)),
                ("num_requests_waiting", "Number of requests waiting to be processed.", info.get("waiting", 0)),
                ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                 info.get("kv_used_tokens", 0) / cap if cap else 0.0)):
            g = GaugeMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            g.add_metric([name], float(value))
            yield g

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())
