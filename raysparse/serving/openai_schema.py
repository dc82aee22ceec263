"""The OpenAI-compatible API's request bodies (pydantic) and its error type.

``APIError`` is an OpenAI-style error response (``{"error": {"message", "type", "param", "code"}}``);
``engine_error`` gives the HTTP status of the engine's typed errors. The bodies accept and ignore unknown
fields, as vLLM does; what they carry beyond OpenAI's fields is vLLM's ``ignore_eos`` and ``stop_token_ids``
and our ``raysparse`` (the attention method per request).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from raysparse.orchestration.engine_api import (
    CapacityExceededError,
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
    RequestTooLargeError,
)


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
class BaseBody(BaseModel):
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


class CompletionBody(BaseBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None


class ChatBody(BaseBody):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None


class TokenizeBody(BaseModel):
    """vLLM's ``/tokenize``: a text (``prompt``) or chat ``messages`` (through the chat template)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]
