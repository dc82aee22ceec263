"""Serving metrics exactly as vLLM's ``bench serve`` defines them, from client-side timestamps.

Per request: TTFT is send to first token; TPOT is (E2EL - TTFT) / (output tokens - 1), defined only for
requests with more than one output token; ITL is every gap between two consecutive streamed chunks
(a chunk carrying several tokens counts once, as vLLM counts its stream chunks); E2EL is send to the last
message. Aggregates: mean, median, std and percentiles (numpy's linear interpolation) in milliseconds;
throughputs divide by the whole run's wall time. Goodput counts the requests that meet every SLO given
(a request with one output token has TPOT 0 for this purpose, as in vLLM).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    prompt_len: int
    t_send: float = 0.0  # perf_counter at send
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with tokens
    output_len: int = 0
    t_end: float = 0.0
    success: bool = False
    error: str = ""
    # The density the server measured for this request (attended / causal pairs over every layer and KV head);
    # None where the server reported none for that phase.
    density_prefill: float | None = None
    density_decode: float | None = None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.t_send if self.chunk_times else 0.0

    @property
    def latency(self) -> float:
        return self.t_end - self.t_send

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        if self.output_len <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)  # vLLM reports 0 for a metric with no samples
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def compute_metrics(records: Sequence[RequestRecord], duration_s: float,
                    slos_ms: Mapping[str, float] | None = None,
                    percentiles: Sequence[float] = (99,)) -> dict[str, Any]:
    """The ``bench serve`` summary of one run that took ``duration_s`` seconds of wall time."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    slos_ms = dict(slos_ms or {})
    bad = set(slos_ms) - set(SLO_METRICS)
    if bad:
        raise ValueError(f"unknown SLO metric(s) {sorted(bad)}; choose from {', '.join(SLO_METRICS)}")
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    ttfts = [r.ttft for r in ok]
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    itls = [x for r in ok for x in r.itl]
    e2els = [r.latency for r in ok]
    good = 0
    for r in ok:
        values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
        good += all(values[k] * 1000.0 <= v for k, v in slos_ms.items())
    out: dict[str, Any] = {
        "duration_s": duration_s, "completed": len(ok), "failed": len(records) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s, "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "request_goodput": good / duration_s if slos_ms else None, "slos_ms": slos_ms,
    }
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        out.update(_stats(name, vals, percentiles))
    # Prefill and decode density apart (a decode-only method prefills densely): the mean over the completed
    # requests that reported one, None where none did.
    for phase in ("prefill", "decode"):
        vals = [v for v in (getattr(r, f"density_{phase}") for r in ok) if v is not None]
        out[f"mean_density_{phase}"] = float(np.mean(vals)) if vals else None
    return out


def parse_slos(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"an SLO is METRIC:MS with METRIC one of {', '.join(SLO_METRICS)}, got {item!r}")
        try:
            v = float(value)
        except ValueError:
            raise ValueError(f"SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if not v > 0:
            raise ValueError(f"SLO {item!r} must be > 0 ms")
        out[name] = v
    return out
