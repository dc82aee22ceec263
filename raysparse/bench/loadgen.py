"""The client-side load generator: prompts of exact token lengths cut from real text, sent over gRPC at a
Poisson request rate (or all at once) under an optional concurrency cap, with per-chunk timestamps.

Prompts are token ids, so every prompt has exactly the length asked for whatever the tokenizer does at a
cut; the tokenizer is the served model's, loaded on the client as vLLM's bench does.
"""

from __future__ import annotations

import contextlib
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from raysparse.bench.metrics import RequestRecord, compute_metrics
from raysparse.serving.client import RaySparseClient, build_request, finish_densities


@dataclass(frozen=True)
class LoadConfig:
    num_prompts: int = 32
    request_rate: float = math.inf  # requests/s with Poisson arrivals; inf: every request at t=0
    burstiness: float = 1.0  # gamma shape of the inter-arrival times (1: Poisson), as in vLLM
    max_concurrency: int | None = None  # cap on requests in flight
    output_len: int = 32
    method: str = "dense"
    method_params: tuple[tuple[str, Any], ...] = ()
    seed: int = 0
    timeout_s: float = 600.0  # per request
    backend: str = "grpc"  # grpc, or openai / openai-chat: the OpenAI-compatible HTTP API (openai_backend)
    model: str = ""  # the model the OpenAI backends name ("": the first one the server lists)
    # Untimed requests of each prompt length before its timed ones (vLLM's warm-ups): kernels compiled on first
    # use and graph captures would otherwise land in the first timed requests' TTFT
    num_warmups: int = 0

    def __post_init__(self) -> None:
        from raysparse.bench.openai_backend import BACKENDS

        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.num_prompts < 1 or self.output_len < 1:
            raise ValueError("num_prompts and output_len must be >= 1")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf for all at once), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.timeout_s > 0:
            raise ValueError("timeout_s must be > 0")


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s from the start) of ``n`` requests: gamma inter-arrivals with mean 1/rate (exponential
    when burstiness is 1, i.e. a Poisson process); all zero for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, theta)
    return out


class PromptSampler:
    """Token-id prompts of exact lengths from windows of real text at seeded random offsets."""

    def __init__(self, text: str, encode: Callable[[str], list[int]], seed: int = 0,
                 decode: Callable[[Sequence[int]], str] | None = None) -> None:
        if len(text) < 1000:
            raise ValueError("the prompt text is too short (need at least 1000 characters)")
        self.text, self.encode, self.rng = text, encode, random.Random(seed)
        self.decode = decode  # token ids back to text, for backends that take text (openai-chat)

    def sample(self, length: int) -> list[int]:
        chars = max(64, length * 8)
        for _ in range(8):
            start = self.rng.randrange(0, max(1, len(self.text) - chars))
            ids = self.encode(self.text[start:start + chars])
            if len(ids) >= length:
                return ids[:length]
            chars *= 2
        ids = self.encode(self.text)
        while len(ids) < length:  # a longer prompt than the text: repeat it
            ids = ids + ids
        return ids[:length]


def run_load(target: str, prompts: Sequence[Sequence[int]], cfg: LoadConfig,
             slos_ms: dict[str, float] | None = None, progress: Callable[[int], None] | None = None,
             decode: Callable[[Sequence[int]], str] | None = None) -> tuple[dict[str, Any], list[RequestRecord]]:
    """Sends every prompt once; returns the metrics summary and the per-request records. ``target`` is the
    gRPC address, or the HTTP base URL for the OpenAI backends (``decode``: ids to text, for openai-chat)."""
    offsets = arrival_offsets(len(prompts), cfg.request_rate, cfg.burstiness, cfg.seed)
    records = [RequestRecord(prompt_len=len(p)) for p in prompts]
    gate = threading.BoundedSemaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    done = [0]
    lock = threading.Lock()
    with contextlib.ExitStack() as stack:
        send = _grpc_sender(stack.enter_context(RaySparseClient(target)), prompts, cfg) if cfg.backend == "grpc" \
            else _openai_sender(target, prompts, cfg, decode)

        def one(i: int) -> None:
            try:
                send(i, records[i])
            finally:
                if gate is not None:
                    gate.release()
                with lock:
                    done[0] += 1
                    if progress is not None:
                        progress(done[0])

        workers = cfg.max_concurrency or len(prompts)
        with ThreadPoolExecutor(max_workers=min(workers, 512)) as pool:
            t0 = time.perf_counter()
            for i, off in enumerate(offsets):
                delay = t0 + off - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                if gate is not None:
                    gate.acquire()
                pool.submit(one, i)
        duration = time.perf_counter() - t0
    return compute_metrics(records, duration, slos_ms), records


def _grpc_sender(client: RaySparseClient, prompts: Sequence[Sequence[int]],
                 cfg: LoadConfig) -> Callable[[int, RequestRecord], None]:
    def send(i: int, rec: RequestRecord) -> None:
        req = build_request(token_ids=list(prompts[i]), method=cfg.method, method_params=dict(cfg.method_params),
                            max_new_tokens=cfg.output_len, ignore_eos=True)
        try:
            rec.t_send = time.perf_counter()
            for ch in client.stream_request(req, timeout=cfg.timeout_s):
                if ch.finish is not None:
                    rec.success = ch.finish.finish_reason in ("length", "stop")
                    rec.error = ch.finish.error or ("" if rec.success else ch.finish.finish_reason)
                    rec.density_prefill, rec.density_decode = finish_densities(ch.finish)
                elif ch.token_ids:
                    rec.chunk_times.append(ch.t)
                    rec.output_len += len(ch.token_ids)
        except grpc.RpcError as e:
            rec.error = f"{e.code().name}: {e.details()}"
        finally:
            rec.t_end = time.perf_counter()

    return send


def _openai_sender(target: str, prompts: Sequence[Sequence[int]], cfg: LoadConfig,
                   decode: Callable[[Sequence[int]], str] | None) -> Callable[[int, RequestRecord], None]:
    from raysparse.bench.openai_backend import OpenAITarget, request_body, send

    url = OpenAITarget.parse(target)
    model = cfg.model or url.served_model()
    if cfg.backend == "openai-chat" and decode is None:
        raise ValueError("the openai-chat backend sends text: give the tokenizer's decode")
    params = dict(cfg.method_params)

    def send_one(i: int, rec: RequestRecord) -> None:
        prompt: Sequence[int] | str = prompts[i]
        if cfg.backend == "openai-chat" and decode is not None:
            prompt = decode(prompts[i])
        send(url, cfg.backend, request_body(cfg.backend, model, prompt, cfg.output_len, cfg.method, params), rec,
             cfg.timeout_s)

    return send_one


@dataclass
class SweepResult:
    prompt_len: int
    metrics: dict[str, Any]
    errors: list[str] = field(default_factory=list)
    warmups_completed: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"prompt_len": self.prompt_len, **self.metrics, "errors": self.errors[:5],
                "warmups_completed": self.warmups_completed}


def sweep(target: str, sampler: PromptSampler, prompt_lens: Sequence[int], cfg: LoadConfig,
          slos_ms: dict[str, float] | None = None, on_step: Callable[[int, dict[str, Any]], None] | None = None
          ) -> list[SweepResult]:
    out = []
    for n in prompt_lens:
        prompts = [sampler.sample(n) for _ in range(cfg.num_prompts)]
        warmed = 0
        if cfg.num_warmups:  # sampled after the timed prompts, so those stay what the seed gives
            warm = [sampler.sample(n) for _ in range(cfg.num_warmups)]
            _, wrecs = run_load(target, warm, replace(cfg, request_rate=math.inf), decode=sampler.decode)
            warmed = sum(1 for r in wrecs if not r.error)
        metrics, records = run_load(target, prompts, cfg, slos_ms, decode=sampler.decode)
        res = SweepResult(n, metrics, sorted({r.error for r in records if r.error}), warmed)
        if on_step is not None:
            on_step(n, res.as_dict())
        out.append(res)
    return out
