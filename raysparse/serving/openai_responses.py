"""Engine events into OpenAI responses: the JSON of a non-streaming request and the SSE chunks of a stream.

A request's events reach the event loop through a listener on its ``RequestHandle`` (``_Events``), so no
thread waits per request. Stop strings are matched here, on the text (``StopStrings``): a match ends the
request (its engine request is aborted) and text that could still become a stop string is held back from
the stream until it is decided. The chat stream's first chunk (the role) comes with the first token, as
vLLM's does; the last tokens come with the finish reason and the ``raysparse`` field in one chunk, then
``usage`` (when asked for) and ``data: [DONE]``. A client that goes away aborts the engine request.
"""

from __future__ import annotations

import asyncio
import json
import queue
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from raysparse.generate import FinishEvent, TokenEvent
from raysparse.orchestration.engine_api import RequestHandle
from raysparse.serving.openai_frontend import Prepared
from raysparse.serving.openai_schema import APIError

_DISCONNECT_POLL_S = 0.5  # how often a non-streaming request looks for a client that went away


# ---- stop strings --------------------------------------------------------------------------------------
@dataclass
class StopStrings:
    """Matches stop strings on the generated text: ``feed`` returns the text that is safe to send."""

    stops: list[str]
    text: str = ""
    sent: int = 0
    stopped: bool = False

    def feed(self, delta: str) -> str:
        self.text += delta
        if not self.stops:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out
        longest = max(len(s) for s in self.stops)
        start = max(0, self.sent - longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            end = min(hits)
            out = self.text[self.sent:end]
            self.text, self.sent, self.stopped = self.text[:end], end, True
            return out
        hold = 0  # the longest tail that is the start of a stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        end = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent:end], end
        return out

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


def _extension(prep: Prepared, handle: RequestHandle, fin: FinishEvent | None,
               handles: list[RequestHandle] | None = None) -> dict[str, Any]:
    req = handle.request
    out: dict[str, Any] = {"request_id": req.request_id, "engine": prep.engine, "method": req.method,
                           "method_params": {k: list(v) if isinstance(v, tuple) else v for k, v in req.method_params}}
    if handles is not None and len(handles) > 1:
        out["request_ids"] = [h.request_id for h in handles]
    if fin is not None:
        out["density"] = fin.stats.get("density", {"prefill": None, "decode": None})
        if "replica" in fin.stats:
            out["replica"] = fin.stats["replica"]
        if req.params.prompt_logprobs is not None:
            # the prompt's log-probabilities come from this request's prefill: a method that prefills sparsely
            # changes them (a prefill density below 1), a decode-only method leaves them dense's
            out["prompt_logprobs"] = {"method": req.method, "prefill_density": out["density"].get("prefill")}
    return out


def _completion_logprobs(entries: list[tuple[int, float | None, tuple[tuple[int, float], ...]]],
                         text_of: Callable[[int], str]) -> dict[str, Any]:
    """OpenAI's completions ``logprobs``: per token its text, log-probability, the most likely alternatives
    (the token's own among them) and its offset in the choice's text."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for tid, lp, top in entries:
        text = text_of(tid)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(None if lp is None else {**{text_of(i): v for i, v in top}, text: lp})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _chat_logprobs(entries: list[tuple[int, float | None, tuple[tuple[int, float], ...]]],
                   text_of: Callable[[int], str]) -> dict[str, Any]:
    """OpenAI's chat ``logprobs``: per token its text, log-probability, UTF-8 bytes and top alternatives."""
    def one(tid: int, lp: float) -> dict[str, Any]:
        text = text_of(tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "surrogatepass"))}

    content = [{**one(tid, lp), "top_logprobs": [one(i, v) for i, v in top]} for tid, lp, top in entries
               if lp is not None]
    return {"content": content, "refusal": None}


def _token_entries(tokens: list[TokenEvent]) -> list[tuple[int, float | None, tuple[tuple[int, float], ...]]]:
    return [(ev.token_id, ev.logprob, ev.top_logprobs) for ev in tokens]


def _usage(prompt: int, completion: int, fin: FinishEvent | None = None) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens whose KV came from a cache
    (the finish event's ``cached_tokens``, 0 when it carries none)."""
    cached = int(fin.stats.get("cached_tokens", 0)) if fin is not None else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}



def _fin_error(fin: FinishEvent) -> APIError | None:
    """A request that ended without a result: the engine failed it or shut down under it."""
    if fin.finish_reason == "error":
        return APIError(500, fin.error or "the request failed", code="engine_error")
    if fin.finish_reason == "abort":
        return APIError(503, fin.error or "the request was aborted", code="aborted")
    return None


class _Events:
    """A request's engine events on the event loop: the engine's thread wakes the loop through a listener."""

    def __init__(self, handle: RequestHandle) -> None:
        self.handle = handle
        self.loop = asyncio.get_running_loop()
        self.wake = asyncio.Event()
        handle.add_listener(self._on_event)
        self.wake.set()  # events queued before the listener was attached are read at once

    def _on_event(self, _ev: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.wake.set)
        except RuntimeError:  # the loop is closed (the server stopped): nobody is reading any more
            pass

    def _drain(self) -> list[TokenEvent | FinishEvent]:
        batch: list[TokenEvent | FinishEvent] = []
        while not (batch and isinstance(batch[-1], FinishEvent)):
            try:
                batch.append(self.handle.get(timeout=0))
            except queue.Empty:
                break
        return batch

    async def next(self, disconnected: Callable[[], Any] | None = None) -> list[TokenEvent | FinishEvent]:
        """Every event queued now (at least one), waiting for the next if none is; a client that went away
        (the coroutine ``disconnected`` says True) raises ``ConnectionAbortedError``."""
        while True:
            batch = self._drain()
            if batch:
                return batch
            self.wake.clear()
            batch = self._drain()  # one that came between the first look and the clear
            if batch:
                return batch
            if disconnected is None:
                await self.wake.wait()
                continue
            try:
                await asyncio.wait_for(self.wake.wait(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await disconnected():
                    raise ConnectionAbortedError("the client went away") from None


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


_DONE = b"data: [DONE]\n\n"


# ---- responses -------------------------------------------------------------------------------------------
@dataclass
class _Choice:
    """One choice's events, read to its end: its tokens (up to a stop string's match) and its finish."""

    stop: StopStrings
    tokens: list[TokenEvent] = field(default_factory=list)
    fin: FinishEvent | None = None


async def _read_choice(handle: RequestHandle, prep: Prepared, request: Request) -> _Choice:
    events = _Events(handle)
    out = _Choice(StopStrings(prep.stops))
    stop = out.stop
    while out.fin is None:
        for ev in await events.next(request.is_disconnected):
            if isinstance(ev, TokenEvent):
                out.tokens.append(ev)
                stop.feed(ev.text)
                if stop.stopped:
                    _end_by_stop(handle)
                    break
            else:
                out.fin = ev
        if stop.stopped:
            break
    if out.fin is not None and (err := _fin_error(out.fin)) is not None:
        raise err
    if out.fin is not None and not stop.stopped:
        stop.flush()
    return out


def _choice_body(c: _Choice, index: int, prep: Prepared, chat: bool) -> dict[str, Any]:
    reason = "stop" if c.stop.stopped else (c.fin.finish_reason if c.fin else "stop")
    tokens = c.tokens
    if c.stop.stopped:  # the tokens whose text the stop string cut off are not the output's
        kept, length = [], 0
        for ev in tokens:
            if length >= len(c.stop.text):
                break
            kept.append(ev)
            length += len(ev.text)
        tokens = kept
    text = c.stop.text
    if prep.prompt_only:  # max_tokens=0: the prompt alone
        tokens, text, reason = [], "", "length"
    logprobs: dict[str, Any] | None = None
    if prep.top_logprobs is not None:
        entries = _token_entries(tokens)
        if prep.echo is not None and c.fin is not None:
            ids = prep.request.prompt_ids
            prompt = c.fin.stats.get("prompt_logprobs") or [None] * len(ids)
            entries = [(tid, None, ()) if e is None else (tid, float(e[1]), tuple(e[2]))
                       for tid, e in zip(ids, prompt, strict=False)] + entries
        logprobs = _chat_logprobs(entries, prep.token_text) if chat else _completion_logprobs(entries, prep.token_text)
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": reason}
    return {"index": index, "text": (prep.echo or "") + text, "logprobs": logprobs, "finish_reason": reason}


async def complete_response(handles: RequestHandle | list[RequestHandle], prep: Prepared, request: Request,
                            chat: bool) -> JSONResponse:
    handles = handles if isinstance(handles, list) else [handles]
    try:
        choices = await asyncio.gather(*(_read_choice(h, prep, request) for h in handles))
    except BaseException:  # the client went away, a choice failed, or the server is stopping: free the KV
        for h in handles:
            h.abort()
        raise
    base = {"id": prep.request.request_id if len(handles) == 1 else prep.request.request_id.rsplit("-", 1)[0],
            "created": int(time.time()), "model": prep.model}
    obj = {**base, "object": "chat.completion" if chat else "text_completion",
           "choices": [_choice_body(c, i, prep, chat) for i, c in enumerate(choices)]}
    generated = 0 if prep.prompt_only else sum(len(c.tokens) for c in choices)
    usage = _usage(len(prep.request.prompt_ids), generated, choices[0].fin)
    usage["prompt_tokens_details"]["cached_tokens"] = sum(
        int(c.fin.stats.get("cached_tokens", 0)) for c in choices if c.fin is not None)
    obj["usage"] = usage
    obj["raysparse"] = _extension(prep, handles[0], choices[0].fin, handles)
    return JSONResponse(obj)


def _end_by_stop(handle: RequestHandle) -> None:
    handle.finish_reason_hint = "stop"  # the metrics count it as a stop, not an abort
    handle.abort()


async def stream_response(prep: Prepared, handle: RequestHandle, chat: bool) -> AsyncIterator[bytes]:
    events = _Events(handle)
    stop = StopStrings(prep.stops)
    created = int(time.time())
    obj_type = "chat.completion.chunk" if chat else "text_completion"
    base = {"id": handle.request_id, "object": obj_type, "created": created, "model": prep.model}
    first, tokens, fin = True, 0, None

    def chunk(text: str | None, reason: str | None = None, role: bool = False,
              toks: list[TokenEvent] | None = None) -> dict[str, Any]:
        lp = None
        if prep.top_logprobs is not None and toks:  # the log-probabilities of the tokens this chunk carries
            entries = _token_entries(toks)
            lp = _chat_logprobs(entries, prep.token_text) if chat else _completion_logprobs(entries, prep.token_text)
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                {"content": text} if text is not None else {})
            c: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": reason}
        else:
            c = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": reason}
        out = {**base, "choices": [c]}
        if prep.include_usage:
            out["usage"] = None
        return out

    try:
        while fin is None and not stop.stopped:
            batch = await events.next()
            text = ""
            toks: list[TokenEvent] = []
            for ev in batch:
                if isinstance(ev, TokenEvent):
                    tokens += 1
                    toks.append(ev)
                    text += stop.feed(ev.text)
                    if stop.stopped:
                        _end_by_stop(handle)
                        break
                else:
                    fin = ev
            if fin is not None and (err := _fin_error(fin)) is not None:
                yield _sse(err.body())
                yield _DONE
                return
            if first and (tokens or fin is not None):
                first = False
                if chat:
                    yield _sse(chunk(None, role=True))
            if fin is not None and not stop.stopped:
                text += stop.flush()
            if fin is None and not stop.stopped:
                if text or (toks and prep.top_logprobs is not None):
                    yield _sse(chunk(text, toks=toks))
                continue
            # the last text and the finish reason in one chunk, as vLLM sends them
            reason = "stop" if stop.stopped or fin is None else fin.finish_reason
            last = chunk(text or (None if chat else ""), reason, toks=toks)
            last["raysparse"] = _extension(prep, handle, fin)
            yield _sse(last)
        if prep.include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(len(prep.request.prompt_ids), tokens, fin)})
        yield _DONE
    finally:  # the client went away (the response was cancelled) or the stream ended: free the KV
        handle.abort()
