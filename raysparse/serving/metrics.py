"""Prometheus metrics of the server, on their own registry so several servers can live in one process.

Latency histograms follow vLLM's names and meaning: TTFT (submission to first token), ITL (between two
consecutive tokens of one request) and E2E (the whole call). KV usage and the measured density per method
are gauges refreshed by the server's poller.

Label values come from closed sets, so no client can grow the number of series: a method label is a
registered method's name or ``invalid``, an outcome is a finish reason or a status code's name, and the
density gauge keeps at most ``MAX_DENSITY_SERIES`` method settings (their parameters come from clients).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


MAX_DENSITY_SERIES = 64


class ServerMetrics:
    INVALID = "invalid"  # the method label of a call whose method is not a registered one

    def __init__(self, registry: CollectorRegistry | None = None, methods: Iterable[str] | None = None) -> None:
        """``methods``: the method names that may appear as labels (default: the registered methods)."""
        self.registry = registry or CollectorRegistry()
        self._methods = frozenset(methods) if methods is not None else None
        self._density_labels: set[str] = set()
        r = self.registry
        self.requests = Counter("raysparse_requests", "Generate calls by attention method and outcome",
                                ["method", "outcome"], registry=r)
        self.prompt_tokens = Counter("raysparse_prompt_tokens", "prompt tokens of finished calls", ["method"],
                                     registry=r)
        self.generation_tokens = Counter("raysparse_generation_tokens", "tokens generated", ["method"], registry=r)
        self.ttft = Histogram("raysparse_time_to_first_token_seconds", "submission to first token", ["method"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("raysparse_inter_token_latency_seconds", "time between consecutive tokens",
                             ["method"], buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("raysparse_e2e_request_latency_seconds", "whole Generate call", ["method"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("raysparse_requests_running", "requests decoding", registry=r)
        self.waiting = Gauge("raysparse_requests_waiting", "requests queued for KV pages", registry=r)
        self.kv_used = Gauge("raysparse_kv_cache_used_tokens", "KV cache tokens reserved", registry=r)
        self.kv_capacity = Gauge("raysparse_kv_cache_capacity_tokens", "KV cache tokens in all replicas", registry=r)
        self.kv_usage = Gauge("raysparse_kv_cache_usage_ratio", "reserved fraction of the KV cache", registry=r)
        self.serving = Gauge("raysparse_serving", "1 while the health service reports SERVING", registry=r)
        self.density = Gauge("raysparse_attention_density", "attended fraction of causal pairs, per method",
                             ["method", "phase"], registry=r)

    def observe_server(self, info: dict[str, Any]) -> None:
        self.running.set(info.get("running", 0))
        self.waiting.set(info.get("waiting", 0))
        used, cap = info.get("kv_used_tokens", 0), info.get("kv_capacity_tokens", 0)
        self.kv_used.set(used)
        self.kv_capacity.set(cap)
        self.kv_usage.set(used / cap if cap else 0.0)
        self.serving.set(1.0 if info.get("serving") else 0.0)

    def method(self, name: str) -> str:
        """The label of the method a client named: the name itself when registered, else ``invalid``."""
        if self._methods is None:  # looked up on first use: the registry imports every method
            from raysparse.methods.registry import method_names

            self._methods = frozenset(method_names())
        return name if name in self._methods else self.INVALID

    def observe_density(self, shard_stats: list[list[dict[str, Any]]]) -> None:
        for method, phase, value in density_by_method(shard_stats):
            # Settings carry client-chosen parameter values: past the cap, new ones are not exported.
            if method not in self._density_labels and len(self._density_labels) >= MAX_DENSITY_SERIES:
                continue
            self._density_labels.add(method)
            self.density.labels(method, phase).set(value)

    def serve_http(self, port: int, host: str = "127.0.0.1") -> Any:
        """Starts the /metrics HTTP endpoint; returns (server, thread) so the caller can stop it."""
        return start_http_server(port, addr=host, registry=self.registry)


def density_by_method(shard_stats: list[list[dict[str, Any]]]) -> list[tuple[str, str, float]]:
    """(method, phase, density) averaged over the replicas, from rank 0 of each (its meter sees every layer).

    ``method`` is the method's label (``name`` or ``name{param=value,...}``); phase ``all`` is prefill and
    decode together, ``prefill`` and ``decode`` each phase's steps alone (absent before its first step)."""
    from raysparse.step_plan import parse_key

    sums: dict[tuple[str, str], list[float]] = {}
    for replica in shard_stats:
        if not replica:
            continue
        for field, phase in (("density", "all"), ("density_prefill", "prefill"), ("density_decode", "decode")):
            for key, value in (replica[0].get(field) or {}).items():
                if isinstance(value, (int, float)):
                    sums.setdefault((method_label(*parse_key(key)), phase), []).append(float(value))
    return [(m, p, sum(v) / len(v)) for (m, p), v in sorted(sums.items())]


def method_label(method: str, params: dict[str, Any]) -> str:
    if not params:
        return method
    return method + "{" + ",".join(f"{k}={v}" for k, v in sorted(params.items())) + "}"
