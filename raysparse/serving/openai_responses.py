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
from dataclasses import dataclass
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


def _extension(prep: Prepared, handle: RequestHandle, fin: FinishEvent | None) -> dict[str, Any]:
    req = handle.request
    out: dict[str, Any] = {"request_id": req.request_id, "engine": prep.engine, "method": req.method,
                           "method_params": {k: list(v) if isinstance(v, tuple) else v for k, v in req.method_params}}
    if fin is not None:
        out["density"] = fin.stats.get("density", {"prefill": None, "decode": None})
        if "replica" in fin.stats:
            out["replica"] = fin.stats["replica"]
    return out


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
async def complete_response(handle: RequestHandle, prep: Prepared, request: Request, chat: bool) -> JSONResponse:
    events = _Events(handle)
    stop = StopStrings(prep.stops)
    tokens, fin = 0, None
    try:
        while fin is None:
            for ev in await events.next(request.is_disconnected):
                if isinstance(ev, TokenEvent):
                    tokens += 1
                    stop.feed(ev.text)
                    if stop.stopped:
                        _end_by_stop(handle)
                        break
                else:
                    fin = ev
            if stop.stopped:
                break
    except BaseException:  # the client went away, or the server is stopping: free the request's KV
        handle.abort()
        raise
    if fin is not None and (err := _fin_error(fin)) is not None:
        raise err
    reason = "stop" if stop.stopped else (fin.finish_reason if fin else "stop")
    if fin is not None and not stop.stopped:
        stop.flush()
    prompt = len(prep.request.prompt_ids)
    base = {"id": handle.request_id, "created": int(time.time()), "model": prep.model}
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": stop.text}, "logprobs": None,
                  "finish_reason": reason}
        obj = {**base, "object": "chat.completion", "choices": [choice]}
    else:
        choice = {"index": 0, "text": stop.text, "logprobs": None, "finish_reason": reason}
        obj = {**base, "object": "text_completion", "choices": [choice]}
    obj["usage"] = _usage(prompt, tokens, fin)
    obj["raysparse"] = _extension(prep, handle, fin)
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

    def chunk(text: str | None, reason: str | None = None, role: bool = False) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                {"content": text} if text is not None else {})
            c: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        out = {**base, "choices": [c]}
        if prep.include_usage:
            out["usage"] = None
        return out

    try:
        while fin is None and not stop.stopped:
            batch = await events.next()
            text = ""
            for ev in batch:
                if isinstance(ev, TokenEvent):
                    tokens += 1
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
                if text:
                    yield _sse(chunk(text))
                continue
            # the last text and the finish reason in one chunk, as vLLM sends them
            reason = "stop" if stop.stopped or fin is None else fin.finish_reason
            last = chunk(text or (None if chat else ""), reason)
            last["raysparse"] = _extension(prep, handle, fin)
            yield _sse(last)
        if prep.include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(len(prep.request.prompt_ids), tokens, fin)})
        yield _DONE
    finally:  # the client went away (the response was cancelled) or the stream ended: free the KV
        handle.abort()
