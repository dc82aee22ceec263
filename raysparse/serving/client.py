"""A small Python client of the raysparse gRPC API.

    with RaySparseClient("127.0.0.1:50051") as c:
        for chunk in c.stream(text="Summarise ...", max_new_tokens=64):
            print(chunk.text, end="")
        result = c.generate(token_ids=[1, 2, 3], method="psaw", method_params={"density": 0.1})

``stream`` yields ``Chunk`` objects (token ids and text delta, and the final one with ``finish`` set);
``generate`` collects them into a ``Completion`` that also records client-side timings (each chunk's arrival).
gRPC errors surface as ``grpc.RpcError`` with the server's status code.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import json_format, struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from raysparse.serving.proto import raysparse_pb2 as pb
from raysparse.serving.proto import raysparse_pb2_grpc as pb_grpc


def finish_densities(fin: pb.Finish) -> tuple[float | None, float | None]:
    """The final message's measured (prefill, decode) density; None for a phase with no metered step."""
    d = fin.density
    return (d.prefill if d.HasField("prefill") else None, d.decode if d.HasField("decode") else None)


@dataclass(frozen=True)
class Chunk:
    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish: pb.Finish | None = None
    t: float = 0.0  # perf_counter() when it arrived


@dataclass
class Completion:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    prompt_tokens: int = 0
    error: str = ""
    server_ttft_s: float = 0.0
    t_start: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of each token (perf_counter)
    t_end: float = 0.0
    density_prefill: float | None = None  # measured by the server; None: no such step was metered
    density_decode: float | None = None
    cached_tokens: int = 0

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.t_start if self.token_times else 0.0

    @property
    def e2e_s(self) -> float:
        return self.t_end - self.t_start

    def as_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "token_ids": self.token_ids, "text": self.text,
                "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens, "error": self.error,
                "ttft_s": self.ttft_s, "e2e_s": self.e2e_s, "density_prefill": self.density_prefill,
                "density_decode": self.density_decode, "cached_tokens": self.cached_tokens}


def build_request(text: str | None = None, token_ids: Sequence[int] | None = None, *, chat: bool = False,
                  method: str = "dense", method_params: Mapping[str, Any] | None = None, max_new_tokens: int = 64,
                  temperature: float = 0.0, top_p: float | None = None, seed: int | None = None,
                  stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
                  request_id: str = "") -> pb.GenerateRequest:
    if (text is None) == (token_ids is None):
        raise ValueError("give exactly one of text and token_ids")
    sampling = pb.SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                 stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    req = pb.GenerateRequest(chat=chat, method=method, sampling=sampling, request_id=request_id)
    if text is not None:
        req.text = text
    else:
        req.token_ids.CopyFrom(pb.TokenIds(ids=list(token_ids or ())))
    if method_params:
        st = struct_pb2.Struct()
        json_format.ParseDict({k: list(v) if isinstance(v, (tuple, list)) else v for k, v in method_params.items()},
                              st)
        req.method_params.CopyFrom(st)
    return req


class RaySparseClient:
    def __init__(self, target: str, channel: grpc.Channel | None = None) -> None:
        self.target = target
        self.channel = channel or grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", -1)])
        self.stub = pb_grpc.RaySparseStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def __enter__(self) -> RaySparseClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def stream_request(self, req: pb.GenerateRequest, timeout: float | None = None) -> Iterator[Chunk]:
        call = self.stub.Generate(req, timeout=timeout)
        try:
            for msg in call:
                now = time.perf_counter()
                if msg.HasField("finish"):
                    yield Chunk(msg.request_id, finish=msg.finish, t=now)
                else:
                    yield Chunk(msg.request_id, tuple(msg.delta.token_ids), msg.delta.text, t=now)
        finally:
            call.cancel()  # a consumer that stops early cancels the call (the server aborts the request)

    def stream(self, text: str | None = None, token_ids: Sequence[int] | None = None, timeout: float | None = None,
               **kw: Any) -> Iterator[Chunk]:
        return self.stream_request(build_request(text, token_ids, **kw), timeout)

    def generate_request(self, req: pb.GenerateRequest, timeout: float | None = None) -> Completion:
        out = Completion(t_start=time.perf_counter())
        for ch in self.stream_request(req, timeout):
            out.request_id = ch.request_id
            if ch.finish is not None:
                f = ch.finish
                out.finish_reason, out.error, out.text = f.finish_reason, f.error, f.text
                out.prompt_tokens, out.server_ttft_s = f.usage.prompt_tokens, f.timings.ttft_s
                out.density_prefill, out.density_decode = finish_densities(f)
                out.cached_tokens = f.cached_tokens
            else:
                out.token_ids.extend(ch.token_ids)
                out.token_times.extend([ch.t] * len(ch.token_ids))
        out.t_end = time.perf_counter()
        return out

    def generate(self, text: str | None = None, token_ids: Sequence[int] | None = None, timeout: float | None = None,
                 **kw: Any) -> Completion:
        return self.generate_request(build_request(text, token_ids, **kw), timeout)

    def abort(self, request_id: str, timeout: float = 10.0) -> bool:
        return self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=timeout).found

    def model_info(self, timeout: float = 10.0) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout)

    def server_info(self, timeout: float = 10.0) -> pb.ServerInfo:
        return self.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout)

    def health(self, service: str = "", timeout: float = 5.0) -> str:
        """SERVING, NOT_SERVING or SERVICE_UNKNOWN."""
        resp = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_serving(self, timeout: float = 300.0, poll_s: float = 0.5) -> None:
        """Blocks until the health service says SERVING; raises TimeoutError."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.health(timeout=min(5.0, max(0.1, deadline - time.monotonic()))) == "SERVING":
                    return
            except grpc.RpcError:
                pass  # not listening yet
            time.sleep(poll_s)
        raise TimeoutError(f"{self.target} was not SERVING within {timeout:.0f} s")
