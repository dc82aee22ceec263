"""The OpenAI-compatible HTTP API over the engine: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

One FastAPI application (``create_app``) serves it wherever the engine lives: beside the gRPC API in
``raysparse serve --http-port`` (``OpenAIHTTPServer``, uvicorn in a thread) and in every replica of the
Ray Serve application (``raysparse.serving.app``). It takes the same requests the gRPC API takes and
refuses the same ones: each request becomes an ``EngineRequest`` and ``Engine.submit`` validates it, its
typed errors mapped to OpenAI-style error bodies (``{"error": {"message", "type", "param", "code"}}``):
400 for bad input (and for a request that can never fit the KV cache), 404 for an unknown model, 429 when
the queue is full, 503 while the engine is loading, rebuilding or draining.

What it takes beyond OpenAI's fields, as vLLM does: ``ignore_eos`` and ``stop_token_ids`` at the top level,
and the attention method per request as ``{"raysparse": {"method": "sketch_walk", "density": 0.1, ...}}``
(every key but ``method`` is a method parameter). Responses carry ``raysparse``: the method, the engine's
request id, the replica, and the prefill and decode density measured for this request.

Streams are server-sent events ending with ``data: [DONE]``; the chat stream's first chunk (the role)
comes with the first token, as vLLM's does, so a client's time to first token is the engine's. A client
that goes away (a stream closed, a connection dropped while waiting) aborts its engine request, whose KV
pages come back at the replica's next step. Stop strings are matched here, on the text: a match ends the
request (its engine request is aborted) and the text before the match is the output; text that could
still become a stop string is held back from the stream until it is decided.
"""

from __future__ import annotations

import asyncio
import json
import queue
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from raysparse.generate import FinishEvent, TokenEvent
from raysparse.orchestration.engine_api import (
    CapacityExceededError,
    EngineError,
    EngineRequest,
    EngineUnavailableError,
    InvalidRequestError,
    RequestHandle,
    RequestTooLargeError,
)
from raysparse.sampling import SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
CHAT_MAX_TOKENS_CAP = 1024  # chat's default: what fits the positions and a replica's KV cache, at most this
MAX_STOP_STRINGS = 4
_DISCONNECT_POLL_S = 0.5  # how often a non-streaming request looks for a client that went away


class APIError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable_error"}.get(self.status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def engine_error(e: Exception) -> APIError:
    """The HTTP status of the engine's typed errors (``engine_api``: the gRPC API uses their ``code``)."""
    if isinstance(e, RequestTooLargeError):  # waiting would not help: the client must ask for less
        return APIError(400, str(e), "max_tokens", "context_length_exceeded")
    if isinstance(e, (InvalidRequestError, ValueError)):
        return APIError(400, str(e))
    if isinstance(e, CapacityExceededError):
        return APIError(429, str(e), code="queue_full")
    if isinstance(e, EngineUnavailableError):
        return APIError(503, str(e), code="unavailable")
    if isinstance(e, EngineError) and e.code == "ALREADY_EXISTS":
        return APIError(409, str(e))
    return APIError(500, f"{type(e).__name__}: {e}")


# ---- requests ------------------------------------------------------------------------------------------
class _Body(BaseModel):
    """Fields shared by both endpoints. Unknown fields are accepted and ignored, as vLLM does."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    # vLLM's extensions
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    # ours
    raysparse: dict[str, Any] | None = None


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None


class ChatBody(_Body):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None


@dataclass
class _Prepared:
    request: EngineRequest
    stops: list[str]
    stream: bool
    include_usage: bool
    model: str
    engine: str = ""  # the engine's name: which Serve replica (or server) answered


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


# ---- the front end ---------------------------------------------------------------------------------------
@dataclass
class OpenAIFrontend:
    """Turns OpenAI requests into engine requests and engine events into OpenAI responses."""

    engine: Any
    served_model_name: str = ""  # "" : the engine's model name
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.served_model_name or getattr(self.engine, "source_name", "") or "raysparse"

    def ready(self) -> bool:
        return getattr(self.engine, "state", "") == "ready" and bool(self.engine.serving())

    def check_ready(self) -> None:
        state = getattr(self.engine, "state", "")
        if state != "ready" or getattr(self.engine, "model_cfg", None) is None:
            raise APIError(503, f"the engine is {state or 'not started'}", code="unavailable")

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict[str, Any]:
        card: dict[str, Any] = {"id": self.model_name, "object": "model", "created": self.created,
                                "owned_by": "raysparse", "root": self.model_name, "parent": None}
        cfg = getattr(self.engine, "model_cfg", None)
        if cfg is not None:
            card["max_model_len"] = cfg.max_position_embeddings
        return card

    def check_model(self, model: str | None) -> str:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
        return self.model_name

    # ---- request building ----------------------------------------------------------------------------
    def _positions_left(self, prompt_len: int) -> int:
        cfg = self.engine.model_cfg
        left = cfg.max_position_embeddings - prompt_len
        kv = getattr(getattr(self.engine, "cfg", None), "kv_cache_tokens", None)
        if kv:
            left = min(left, kv - prompt_len)
        return max(1, min(left, CHAT_MAX_TOKENS_CAP))

    def _common(self, body: _Body, ids: list[int], default_max: int | None, max_tokens: int | None,
                rid: str) -> _Prepared:
        for name, value, ok in (("n", body.n, (None, 1)), ("best_of", body.best_of, (None, 1)),
                                ("presence_penalty", body.presence_penalty, (None, 0, 0.0)),
                                ("frequency_penalty", body.frequency_penalty, (None, 0, 0.0))):
            if value not in ok:
                raise APIError(400, f"{name}={value!r} is not supported (only {ok[1]!r})", name)
        if body.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
        method, params = "dense", {}
        if body.raysparse is not None:
            ext = dict(body.raysparse)
            method = ext.pop("method", "dense")
            if not isinstance(method, str) or not method:
                raise APIError(400, "raysparse.method must be a non-empty string", "raysparse")
            nested = ext.pop("params", None) or {}
            if not isinstance(nested, dict):
                raise APIError(400, "raysparse.params must be an object", "raysparse")
            params = {**ext, **nested}
            params = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}
        n = max_tokens if max_tokens is not None else (default_max or self._positions_left(len(ids)))
        try:
            sampling = SamplingParams(
                max_new_tokens=n, temperature=1.0 if body.temperature is None else float(body.temperature),
                top_p=1.0 if body.top_p is None else float(body.top_p), seed=body.seed,
                stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=bool(body.ignore_eos))
            req = EngineRequest(ids, sampling, method, params, request_id=rid)
        except EngineError as e:
            raise engine_error(e) from None
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None
        opts = body.stream_options or {}
        return _Prepared(req, [s for s in stops if s], bool(body.stream), bool(opts.get("include_usage")),
                         self.model_name, str(getattr(self.engine, "name", "")))

    def prepare_completion(self, body: CompletionBody) -> _Prepared:
        self.check_ready()
        self.check_model(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported", "echo")
        if body.logprobs is not None:
            raise APIError(400, "logprobs are not supported", "logprobs")
        if body.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        p = body.prompt
        if isinstance(p, list) and p and all(isinstance(x, list) for x in p):
            if len(p) != 1:
                raise APIError(400, "one prompt per request (a batch of prompts is not supported)", "prompt")
            p = p[0]
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise APIError(400, "one prompt per request (a batch of prompts is not supported)", "prompt")
            p = p[0]
        if isinstance(p, str):
            if not p.strip():  # as the gRPC API: whitespace alone tokenizes to nothing useful
                raise APIError(400, "prompt is empty (or whitespace only)", "prompt")
            try:
                ids = list(self.engine.encode(p, chat=False))
            except EngineError as e:
                raise engine_error(e) from None
        else:
            ids = list(p)
            if not ids:
                raise APIError(400, "prompt is empty", "prompt")
        return self._common(body, ids, COMPLETIONS_DEFAULT_MAX_TOKENS, body.max_tokens, f"cmpl-{uuid.uuid4().hex}")

    def prepare_chat(self, body: ChatBody) -> _Prepared:
        self.check_ready()
        self.check_model(body.model)
        if body.logprobs or body.top_logprobs:
            raise APIError(400, "logprobs are not supported", "logprobs")
        if body.tools:
            raise APIError(400, "tools are not supported", "tools")
        ids = self.chat_ids(body.messages)
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return self._common(body, ids, None, limit, f"chatcmpl-{uuid.uuid4().hex}")

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        tok = getattr(self.engine, "tokenizer", None)
        if tok is None:
            raise APIError(400, "this model has no tokenizer: use /v1/completions with token ids", "messages")
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template: use /v1/completions", "messages")
        if not messages:
            raise APIError(400, "messages is empty", "messages")
        conv = []
        for i, m in enumerate(messages):
            role, content = m.get("role"), m.get("content")
            if not isinstance(role, str):
                raise APIError(400, f"messages[{i}].role must be a string", "messages")
            if isinstance(content, list):  # content parts: text only
                texts = []
                for part in content:
                    text_part = isinstance(part, dict) and part.get("type") == "text"
                    if not (text_part and isinstance(part.get("text"), str)):
                        raise APIError(400, f"messages[{i}].content: only text parts are supported", "messages")
                    texts.append(part["text"])
                content = "".join(texts)
            elif content is None:
                content = ""
            elif not isinstance(content, str):
                raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
            conv.append({"role": role, "content": content})
        try:
            text = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # the template's own checks (e.g. roles that must alternate)
            raise APIError(400, f"the chat template refused the messages: {e}", "messages") from None
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise APIError(400, "the messages tokenize to nothing", "messages")
        return list(ids)

    def submit(self, prep: _Prepared) -> RequestHandle:
        try:
            return self.engine.submit(prep.request)
        except (EngineError, ValueError) as e:
            raise engine_error(e) from None


def _extension(prep: _Prepared, handle: RequestHandle, fin: FinishEvent | None) -> dict[str, Any]:
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


def _finish_reason(fin: FinishEvent, stopped: bool) -> str:
    return "stop" if stopped else fin.finish_reason


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
async def _complete(handle: RequestHandle, prep: _Prepared, request: Request, chat: bool) -> JSONResponse:
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


async def _stream(prep: _Prepared, handle: RequestHandle, chat: bool) -> AsyncIterator[bytes]:
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


# ---- the application ---------------------------------------------------------------------------------
def create_app(get_frontend: Callable[[], OpenAIFrontend], metrics_registry: Any = None) -> FastAPI:
    """The FastAPI application. ``get_frontend`` is called per request (the Serve app builds its engine
    after the routes exist); ``metrics_registry`` adds ``/metrics`` (Prometheus text) when given."""
    app = FastAPI(title="raysparse OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: {err.get('msg')}"
                        for err in errors[:5])
        return JSONResponse(APIError(400, msg or "invalid request", loc[0] if loc else None).body(), 400)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if get_frontend().ready() else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return get_frontend().models()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        fe = get_frontend()
        fe.check_model(model)
        return fe.model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Response:
        return await _serve(get_frontend(), body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request) -> Response:
        return await _serve(get_frontend(), body, request, chat=True)

    if metrics_registry is not None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        @app.get("/metrics")
        async def metrics() -> Response:
            body = await asyncio.to_thread(generate_latest, metrics_registry)  # the gauges ask the engine
            return Response(body, media_type=CONTENT_TYPE_LATEST)

    return app


async def _serve(fe: OpenAIFrontend, body: Any, request: Request, chat: bool) -> Response:
    prepare = fe.prepare_chat if chat else fe.prepare_completion
    # tokenizing a long prompt (and validating a method's first request) must not stall the event loop
    prep = await asyncio.to_thread(prepare, body)
    handle = await asyncio.to_thread(fe.submit, prep)  # a refusal is an error status, never a stream event
    if not prep.stream:
        return await _complete(handle, prep, request, chat)
    return StreamingResponse(_stream(prep, handle, chat), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
