"""The bench's OpenAI-compatible backends: one streamed request to ``/v1/completions`` (``openai``) or
``/v1/chat/completions`` (``openai-chat``), timed the way vLLM's ``bench serve`` times its backends of the
same names, so figures from raysparse's HTTP API and from a vLLM server compare on the same definitions:

- the request is what vLLM sends: ``stream`` with ``stream_options.include_usage``, ``max_tokens`` the output
  length, temperature 0, and ``ignore_eos`` (so every request generates exactly that many tokens);
- every SSE chunk that has ``choices`` is one arrival: the first gives TTFT, each later one an ITL gap (a
  chunk counts whatever its text, as vLLM counts them; raysparse sends the last tokens and the finish
  reason in one chunk, and the chat stream's role chunk together with the first token, as vLLM does);
- the output length is the final ``usage.completion_tokens``;
- E2EL runs from the send to the end of the stream (``[DONE]``).

Prompts are token ids for ``openai`` (exact lengths; the completions API takes them as vLLM's does) and their
decoded text for ``openai-chat``. The attention method goes in the ``raysparse`` extension field.
It speaks HTTP through the standard library (``http.client``), one connection per request, from the load
generator's threads.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from raysparse.bench.metrics import RequestRecord

BACKENDS = ("grpc", "openai", "openai-chat")


@dataclass(frozen=True)
class OpenAITarget:
    host: str
    port: int
    base_path: str  # "/v1"
    https: bool = False

    @classmethod
    def parse(cls, target: str) -> OpenAITarget:
        """``http://HOST:PORT`` or ``http://HOST:PORT/v1`` (``HOST:PORT`` alone is taken as http)."""
        url = urllib.parse.urlsplit(target if "://" in target else f"http://{target}")
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"--target {target!r}: expected http://HOST:PORT[/v1] for an OpenAI backend")
        path = url.path.rstrip("/")
        if not path.endswith("/v1"):
            path += "/v1"
        return cls(url.hostname, url.port or (443 if url.scheme == "https" else 80), path, url.scheme == "https")

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=timeout)

    def get_json(self, path: str, timeout: float = 10.0) -> Any:
        conn = self.connection(timeout)
        try:
            conn.request("GET", self.base_path + path)
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise OSError(f"GET {self.base_path + path}: HTTP {resp.status}")
            return json.loads(body)
        finally:
            conn.close()

    def served_model(self, timeout: float = 10.0) -> str:
        """The first model ``/v1/models`` lists."""
        data = self.get_json("/models", timeout).get("data") or []
        if not data:
            raise OSError(f"{self.host}:{self.port} serves no model")
        return str(data[0]["id"])


def request_body(backend: str, model: str, prompt: Sequence[int] | str, output_len: int, method: str,
                 method_params: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": output_len, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}, "ignore_eos": True}
    if backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = list(prompt) if not isinstance(prompt, str) else prompt
    if method != "dense" or method_params:
        body["raysparse"] = {"method": method, **{k: list(v) if isinstance(v, tuple) else v
                                                  for k, v in method_params.items()}}
    return body


def send(target: OpenAITarget, backend: str, body: dict[str, Any], rec: RequestRecord, timeout: float,
         now: Callable[[], float] = time.perf_counter) -> None:
    """Sends one streamed request and fills ``rec`` (chunk arrivals, output length, success or error)."""
    path = target.base_path + ("/chat/completions" if backend == "openai-chat" else "/completions")
    data = json.dumps(body).encode()
    conn = target.connection(timeout)
    try:
        rec.t_send = now()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json",
                                                       "Accept": "text/event-stream"})
        resp = conn.getresponse()
        if resp.status != 200:
            raw = resp.read()
            try:
                msg = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = raw[:200].decode(errors="replace")
            rec.error = f"HTTP {resp.status}: {msg}"
            return
        finish, usage_tokens = "", None
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            t = now()
            chunk = json.loads(payload)
            if "error" in chunk:
                rec.error = str(chunk["error"].get("message", chunk["error"]))
                return
            if chunk.get("choices"):
                rec.chunk_times.append(t)
                finish = chunk["choices"][0].get("finish_reason") or finish
                dens = (chunk.get("raysparse") or {}).get("density")  # raysparse's extension, last chunk only
                if dens:
                    rec.density_prefill, rec.density_decode = dens.get("prefill"), dens.get("decode")
            elif chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
        rec.output_len = int(usage_tokens) if usage_tokens is not None else len(rec.chunk_times)
        rec.success = finish in ("length", "stop")
        if not rec.success:
            rec.error = f"finish_reason {finish or 'missing'}"
    except (OSError, http.client.HTTPException, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    finally:
        rec.t_end = now()
        conn.close()
