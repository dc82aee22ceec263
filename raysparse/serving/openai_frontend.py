"""``OpenAIFrontend``: OpenAI requests into engine requests (``Prepared``), and the model list.

It checks what the API does not offer (tools, ``logit_bias``, ``suffix``, ``best_of`` other than ``n``;
``n`` > 1 and ``echo`` in a stream), tokenizes the prompt (the chat template for chat; token-id prompts as
they are), reads the ``raysparse`` extension field into the method and its parameters, builds the
``SamplingParams`` and ``EngineRequest`` the gRPC servicer would (one per choice: ``n`` requests, seeds
``seed + i``, whose prompt pages the prefix cache shares), and submits them: ``Engine.submit``'s typed
errors become ``APIError``. Log-probabilities are the model's own (``SamplingParams.logprobs``); ``echo``
asks the engine for the prompt's too, and ``max_tokens=0`` with ``echo`` scores the prompt alone (the engine
samples one token, which the response leaves out).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from raysparse.orchestration.engine_api import EngineError, EngineRequest, RequestHandle
from raysparse.sampling import SamplingParams
from raysparse.serving.openai_schema import (
    APIError,
    BaseBody,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    TokenizeBody,
    engine_error,
)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
CHAT_MAX_TOKENS_CAP = 1024  # chat's default: what fits the positions and a replica's KV cache, at most this
MAX_STOP_STRINGS = 4
MAX_N = 16  # choices per request


def token_texts(tokenizer: Any) -> Callable[[int], str]:
    """A token's text as the logprobs fields spell it (its own decoding; ``token_id:N`` without a tokenizer)."""
    if tokenizer is None:
        return lambda i: f"token_id:{i}"
    return lambda i: tokenizer.decode([i])


@dataclass
class Prepared:
    """An OpenAI request turned into an engine request, with what its response needs."""

    request: EngineRequest
    stops: list[str]
    stream: bool
    include_usage: bool
    model: str
    engine: str = ""  # the engine's name: which Serve replica (or server) answered
    requests: list[EngineRequest] = field(default_factory=list)  # one per choice (``request`` is the first)
    echo: str | None = None  # the prompt's text, put before each choice's text (completions' ``echo``)
    prompt_only: bool = False  # ``max_tokens=0`` with ``echo``: the prompt scored, no generated token kept
    top_logprobs: int | None = None  # alternatives per token in the response; None: no logprobs field
    token_text: Callable[[int], str] = str


@dataclass
class OpenAIFrontend:
    """Turns OpenAI requests into engine requests (``openai_responses`` turns their events into responses)."""

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

    def _common(self, body: BaseBody, ids: list[int], default_max: int | None, max_tokens: int | None,
                rid: str, logprobs: int | None = None, echo: str | None = None) -> Prepared:
        n_choices = 1 if body.n is None else body.n
        if not 1 <= n_choices <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {n_choices}", "n")
        if body.best_of not in (None, n_choices):
            raise APIError(400, f"best_of={body.best_of!r} is not supported (only n's value, {n_choices})", "best_of")
        if body.stream and (n_choices > 1 or echo is not None):
            raise APIError(400, "n > 1 and echo are not supported with stream: true", "n" if n_choices > 1 else "echo")
        if body.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")
        prompt_only = echo is not None and max_tokens == 0  # scores the prompt: loglikelihood requests
        if max_tokens is not None and max_tokens < 1 and not prompt_only:
            raise APIError(400, f"max_tokens must be at least 1 (0 with echo), got {max_tokens}", "max_tokens")
        if prompt_only:
            max_tokens = 1
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
                stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=bool(body.ignore_eos),
                logprobs=logprobs, prompt_logprobs=logprobs if echo is not None else None,
                presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0)
            # n choices: n requests, each its own seed (the same seed would draw the same sample n times)
            reqs = [EngineRequest(ids, sampling if body.seed is None or n_choices == 1 else
                                  replace(sampling, seed=(body.seed + i) % 2**63), method, params,
                                  request_id=rid if n_choices == 1 else f"{rid}-{i}") for i in range(n_choices)]
        except EngineError as e:
            raise engine_error(e) from None
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None
        opts = body.stream_options or {}
        return Prepared(reqs[0], [s for s in stops if s], bool(body.stream), bool(opts.get("include_usage")),
                        self.model_name, str(getattr(self.engine, "name", "")), requests=reqs, echo=echo,
                        prompt_only=prompt_only, top_logprobs=logprobs,
                        token_text=token_texts(getattr(self.engine, "tokenizer", None)))

    def prepare_completion(self, body: CompletionBody) -> Prepared:
        self.check_ready()
        self.check_model(body.model)
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
        echo = None
        if body.echo:
            tok = getattr(self.engine, "tokenizer", None)
            echo = p if isinstance(p, str) else (tok.decode(ids) if tok is not None else "")
        return self._common(body, ids, COMPLETIONS_DEFAULT_MAX_TOKENS, body.max_tokens, f"cmpl-{uuid.uuid4().hex}",
                            body.logprobs, echo)

    def prepare_chat(self, body: ChatBody) -> Prepared:
        self.check_ready()
        self.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if body.tools:
            raise APIError(400, "tools are not supported", "tools")
        ids = self.chat_ids(body.messages)
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return self._common(body, ids, None, limit, f"chatcmpl-{uuid.uuid4().hex}",
                            (body.top_logprobs or 0) if body.logprobs else None)

    def tokenize(self, body: TokenizeBody) -> dict[str, Any]:
        """vLLM's ``/tokenize``: the ids a prompt (or chat messages) becomes, their count and the model's length."""
        self.check_ready()
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give prompt or messages (one of them)", "prompt")
        if body.messages is not None:
            ids = self.chat_ids(body.messages)
        else:
            tok = getattr(self.engine, "tokenizer", None)
            if tok is None:
                raise APIError(400, "this model has no tokenizer", "prompt")
            ids = list(tok(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
        return {"count": len(ids), "max_model_len": self.engine.model_cfg.max_position_embeddings, "tokens": ids}

    def detokenize(self, body: DetokenizeBody) -> dict[str, Any]:
        """vLLM's ``/detokenize``: the text of token ids."""
        self.check_ready()
        self.check_model(body.model)
        tok = getattr(self.engine, "tokenizer", None)
        if tok is None:
            raise APIError(400, "this model has no tokenizer", "tokens")
        vocab = self.engine.model_cfg.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary ({vocab})", "tokens")
        return {"prompt": tok.decode(body.tokens)}

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

    def submit(self, prep: Prepared) -> RequestHandle:
        return self.submit_all(prep)[0]

    def submit_all(self, prep: Prepared) -> list[RequestHandle]:
        """One handle per choice; a refusal of any aborts those already submitted."""
        handles: list[RequestHandle] = []
        try:
            for req in prep.requests or [prep.request]:
                handles.append(self.engine.submit(req))
        except (EngineError, ValueError) as e:
            for h in handles:
                h.abort()
            raise engine_error(e) from None
        return handles
