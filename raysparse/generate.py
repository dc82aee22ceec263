"""Batched generation: one packed prefill, then decode steps over every live sequence, streaming events.

A request's KV pages are reserved at admission (prompt + max new tokens), so a request that cannot fit
fails before any work; a failure inside one request's step frees its pages and leaves the others alive.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from raysparse.attention import AttentionBackend
from raysparse.kv_cache import KVCache
from raysparse.model import LlamaForCausalLM
from raysparse.sampling import Sampler, SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    request_id: str = ""

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt is empty")


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token_id: int
    text: str  # the text this token completes (may be empty while a multi-byte character is pending)
    # with ``SamplingParams.logprobs``: the token's log-probability and its most likely alternatives (id, logprob)
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class FinishEvent:
    request_id: str
    finish_reason: str  # "stop", "length", "abort" or "error"
    token_ids: tuple[int, ...]
    text: str
    prompt_tokens: int
    ttft_s: float
    decode_s: float
    error: str = ""
    stats: dict[str, Any] = field(default_factory=dict)  # engine extras: replica, method, queue time

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1  # the first token comes out of prefill
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


@dataclass
class _Live:
    req: GenerationRequest
    seq_id: int
    stops: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    t_first: float = 0.0


class Generator:
    _ids = itertools.count()

    def __init__(self, model: LlamaForCausalLM, cache: KVCache, backend: AttentionBackend,
                 tokenizer: Any | None = None, eos_token_ids: Sequence[int] = ()) -> None:
        self.model, self.cache, self.backend, self.tokenizer = model, cache, backend, tokenizer
        eos = set(eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos = frozenset(eos)
        self.sampler = Sampler()

    def _detok(self, live: _Live) -> str:
        delta, live.text = text_delta(self.tokenizer, live.tokens, live.text)
        return delta

    def _release(self, seq_id: int) -> None:
        self.cache.free(seq_id)
        self.backend.release(seq_id)
        self.sampler.remove(seq_id)

    def _finish(self, live: _Live, reason: str, t0: float, error: str = "") -> FinishEvent:
        self._release(live.seq_id)
        now = time.perf_counter()
        ttft = live.t_first - t0 if live.t_first else now - t0
        return FinishEvent(live.req.request_id, reason, tuple(live.tokens), live.text,
                           len(live.req.prompt_ids), ttft, now - live.t_first if live.t_first else 0.0, error)

    def _accept(self, live: _Live, token: int, t0: float) -> Iterator[TokenEvent | FinishEvent]:
        """Records one sampled token; yields its event and, when the request ends, its finish."""
        p = live.req.params
        if token in live.stops:
            yield self._finish(live, "stop", t0)
            return
        live.tokens.append(token)
        yield TokenEvent(live.req.request_id, token, self._detok(live))
        if len(live.tokens) >= p.max_new_tokens:
            yield self._finish(live, "length", t0)

    def _admit(self, requests: Sequence[GenerationRequest]) -> list[_Live]:
        """Checks every request against the model's positions and reserves its cache: all or none."""
        limit = self.model.cfg.max_position_embeddings
        lives: list[_Live] = []
        try:
            for r in requests:
                total = len(r.prompt_ids) + r.params.max_new_tokens
                if total > limit:
                    raise ValueError(f"prompt ({len(r.prompt_ids)} tokens) plus max_new_tokens "
                                     f"({r.params.max_new_tokens}) exceeds the model's {limit} positions")
                sid = next(self._ids)
                self.cache.allocate(sid, total)
                stops = frozenset(r.params.stop_token_ids) | (frozenset() if r.params.ignore_eos else self.eos)
                lives.append(_Live(r, sid, stops))
                self.sampler.add(sid, r.params)
        except Exception:
            for live in lives:
                self._release(live.seq_id)
            raise
        return lives

    def generate(self, requests: Sequence[GenerationRequest],
                 on_prefill_layer: Callable[[int], None] | None = None) -> Iterator[TokenEvent | FinishEvent]:
        t0 = time.perf_counter()
        lives = self._admit(requests)
        try:
            ids = torch.tensor([t for live in lives for t in live.req.prompt_ids], dtype=torch.long)
            batch = self.cache.prepare([lv.seq_id for lv in lives], [len(lv.req.prompt_ids) for lv in lives], True)
            logits = self.model(ids.to(self.cache.device), batch, self.cache, self.backend, on_layer=on_prefill_layer)
            tokens = self.sampler.sample(logits, batch.seq_ids, [lv.req.params for lv in lives])
            now = time.perf_counter()
            alive: list[_Live] = []
            for live, tok in zip(lives, tokens, strict=True):
                live.t_first = now
                for ev in self._accept(live, tok, t0):
                    yield ev
                    if isinstance(ev, FinishEvent):
                        break
                else:
                    alive.append(live)

            while alive:
                last = torch.tensor([lv.tokens[-1] for lv in alive], dtype=torch.long, device=self.cache.device)
                batch = self.cache.prepare([lv.seq_id for lv in alive], [1] * len(alive), False)
                logits = self.model(last, batch, self.cache, self.backend)
                tokens = self.sampler.sample(logits, batch.seq_ids, [lv.req.params for lv in alive])
                still: list[_Live] = []
                for live, tok in zip(alive, tokens, strict=True):
                    finished = False
                    for ev in self._accept(live, tok, t0):
                        finished = finished or isinstance(ev, FinishEvent)
                        yield ev
                    if not finished:
                        still.append(live)
                alive = still

        finally:
            # A consumer that stops early, or an error mid-step, must not leak KV pages.
            for live in lives:
                self._release(live.seq_id)


def text_delta(tokenizer: Any | None, tokens: Sequence[int], text: str) -> tuple[str, str]:
    """Incremental detokenisation: (new text since ``text``, the full text) after the latest token."""
    if tokenizer is None:
        return "", text
    full = tokenizer.decode(tokens, skip_special_tokens=True)
    if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
        return "", text
    return full[len(text):], full


def chat_prompt_ids(tokenizer: Any, user_message: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat through the model's own chat template."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user_message}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
