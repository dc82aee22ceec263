"""The OpenAI-compatible HTTP API over the engine: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
and vLLM's ``/tokenize``, ``/detokenize``, ``/health`` and ``/version``.

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

For evaluation and sampling clients it serves what vLLM serves: ``logprobs`` on completions (each token's
log-probability with its top alternatives) and ``logprobs``/``top_logprobs`` on chat, ``echo`` with the
prompt's log-probabilities (``max_tokens=0`` scores the prompt alone: lm-evaluation-harness's loglikelihood
requests), ``n`` choices (their prompt's full pages shared through the prefix cache), ``presence_penalty``
and ``frequency_penalty``. The log-probabilities are the model's own distribution, before temperature,
top_p and penalties; a method that prefills sparsely changes a prompt's, and ``raysparse.prompt_logprobs``
names the method and the prefill density that made them.

Streams are server-sent events ending with ``data: [DONE]``; the chat stream's first chunk (the role)
comes with the first token, as vLLM's does, so a client's time to first token is the engine's. A client
that goes away (a stream closed, a connection dropped while waiting) aborts its engine request, whose KV
pages come back at the replica's next step. Stop strings are matched on the text: a match ends the
request (its engine request is aborted) and the text before the match is the output; text that could
still become a stop string is held back from the stream until it is decided.

This module holds the application and its routes; the request bodies and ``APIError`` are in
``openai_schema``, request building in ``openai_frontend`` and the responses (JSON and SSE) in
``openai_responses``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from raysparse.serving.openai_frontend import OpenAIFrontend
from raysparse.serving.openai_responses import complete_response, stream_response
from raysparse.serving.openai_schema import APIError, ChatBody, CompletionBody, DetokenizeBody, TokenizeBody


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

    @app.get("/version")
    async def version() -> dict[str, Any]:
        from raysparse import __version__

        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody) -> dict[str, Any]:
        return await asyncio.to_thread(get_frontend().tokenize, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody) -> dict[str, Any]:
        return await asyncio.to_thread(get_frontend().detokenize, body)

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
    handles = await asyncio.to_thread(fe.submit_all, prep)  # a refusal is an error status, never a stream event
    if not prep.stream:
        return await complete_response(handles, prep, request, chat)
    return StreamingResponse(stream_response(prep, handles[0], chat), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
