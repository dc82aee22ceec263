"""The ``raysparse.v1.RaySparse`` servicer: gRPC calls onto the engine, with the status codes of the API.

Every refusal is decided before a request reaches the engine's queue or by ``Engine.submit`` itself, whose
typed errors carry the status code (``engine_api``). A call that ends early - the client cancels, its
deadline passes, the connection drops - aborts its engine request from the RPC's termination callback, so
its KV pages come back at the replica's next step even while the request is still waiting.

The control calls (``Abort``, ``GetModelInfo``, ``GetServerInfo``) run on a thread pool of their own
(``add_to_server``'s ``control_pool``), so they are answered at once however many streams hold the server's
threads.

Client input never reaches an error path of its own: a request whose bytes do not parse is
INVALID_ARGUMENT (``add_to_server``), a request id already in flight is ALREADY_EXISTS, and metric labels
take their values from closed sets (``ServerMetrics.method``).
"""

from __future__ import annotations

import functools
import queue
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from raysparse.generate import FinishEvent, TokenEvent
from raysparse.orchestration.engine_api import EngineError, EngineRequest, InvalidRequestError
from raysparse.sampling import SamplingParams
from raysparse.serving.metrics import ServerMetrics
from raysparse.serving.proto import raysparse_pb2 as pb
from raysparse.serving.proto import raysparse_pb2_grpc as pb_grpc

DEFAULT_MAX_NEW_TOKENS = 64
_POLL_S = 0.1  # how often a streaming call notices that its client went away
_SERVICE = pb.DESCRIPTOR.services_by_name["RaySparse"]
CONTROL_METHODS = frozenset({"Abort", "GetModelInfo", "GetServerInfo"})  # served from ``control_pool``


def finish_density(fin: FinishEvent) -> pb.Density:
    """The request's measured prefill and decode density; a phase with no metered step stays unset."""
    d = fin.stats.get("density") or {}
    return pb.Density(**{k: float(d[k]) for k in ("prefill", "decode") if d.get(k) is not None})


@dataclass(frozen=True)
class UndecodableRequest:
    """Stands for a request whose bytes do not parse (e.g. a string field that is not UTF-8)."""

    error: str


def _tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as e:
            return UndecodableRequest(str(e) or "malformed message")
    return deserialize


def on_pool(handler: Callable[..., Any], pool: futures.ThreadPoolExecutor) -> Callable[..., Any]:
    """``handler`` run on ``pool`` rather than on the server's own thread pool: grpcio's server takes a
    behaviour's ``experimental_thread_pool`` (as its health servicer does for ``Watch``)."""
    @functools.wraps(handler)
    def call(request: Any, context: grpc.ServicerContext, *rest: Any) -> Any:
        return handler(request, context, *rest)

    call.experimental_thread_pool = pool  # type: ignore[attr-defined]
    return call


def add_to_server(servicer: RaySparseServicer, server: grpc.Server,
                  control_pool: futures.ThreadPoolExecutor | None = None) -> None:
    """What the generated ``add_RaySparseServicer_to_server`` does, with deserializers that never raise.

    grpc's server answers a request it cannot deserialize with INTERNAL before any handler runs; such a
    request is the client's fault, so it reaches the handler as an ``UndecodableRequest``, which every
    handler refuses with INVALID_ARGUMENT. The handlers follow the service descriptor, so a method added
    to the proto is served the same way. ``control_pool``: where ``CONTROL_METHODS`` run (default: the
    server's own pool, which every open stream holds a thread of)."""
    handlers = {}
    for m in _SERVICE.methods:
        make = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
        behaviour = getattr(servicer, m.name)
        if control_pool is not None and m.name in CONTROL_METHODS:
            behaviour = on_pool(behaviour, control_pool)
        handlers[m.name] = make(behaviour,
                                request_deserializer=_tolerant(getattr(pb, m.input_type.name).FromString),
                                response_serializer=getattr(pb, m.output_type.name).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(_SERVICE.full_name, handlers)


def _refuse_undecodable(request: Any, context: grpc.ServicerContext) -> None:
    if isinstance(request, UndecodableRequest):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request cannot be decoded: {request.error}")


def _method_params(msg: pb.GenerateRequest) -> tuple[tuple[str, Any], ...]:
    if not msg.HasField("method_params"):
        return ()
    out: dict[str, Any] = {}
    for k, v in json_format.MessageToDict(msg.method_params).items():
        out[k] = tuple(_number(x) for x in v) if isinstance(v, list) else _number(v)
    return tuple(sorted(out.items()))


def _number(v: Any) -> Any:
    """Struct numbers are doubles: integral ones become ints (layer indices, block sizes)."""
    return int(v) if isinstance(v, float) and v.is_integer() and abs(v) < 2**53 else v


def sampling_from_proto(s: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError (INVALID_ARGUMENT) for bad values."""
    return SamplingParams(max_new_tokens=s.max_new_tokens or DEFAULT_MAX_NEW_TOKENS, temperature=s.temperature,
                          top_p=s.top_p if s.HasField("top_p") else 1.0,
                          seed=s.seed if s.HasField("seed") else None,
                          stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos)


class RaySparseServicer(pb_grpc.RaySparseServicer):
    def __init__(self, engine: Any, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics or ServerMetrics()

    # ---- Generate -----------------------------------------------------------------------------------
    def _request(self, msg: pb.GenerateRequest) -> EngineRequest:
        kind = msg.WhichOneof("prompt")
        if kind == "text":
            if not msg.text.strip():  # whitespace alone tokenizes to nothing useful (or to nothing at all)
                raise InvalidRequestError("prompt is empty (or whitespace only)")
            ids = self.engine.encode(msg.text, chat=msg.chat)
        elif kind == "token_ids":
            ids = list(msg.token_ids.ids)
        else:
            raise InvalidRequestError("prompt is empty: set text or token_ids")
        extra = {"request_id": msg.request_id} if msg.request_id else {}
        return EngineRequest(ids, sampling_from_proto(msg.sampling), msg.method or "dense", _method_params(msg),
                             **extra)

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        t0 = time.perf_counter()
        if isinstance(request, UndecodableRequest):
            self._refuse(context, self.metrics.INVALID, grpc.StatusCode.INVALID_ARGUMENT,
                         f"the request cannot be decoded: {request.error}")
        method = self.metrics.method(request.method or "dense")  # the metrics' label, not the request's
        if getattr(self.engine, "state", "") != "ready":
            self._refuse(context, method, grpc.StatusCode.UNAVAILABLE, f"the engine is {self.engine.state}")
        try:
            handle = self.engine.submit(self._request(request))
        except EngineError as e:
            self._refuse(context, method, getattr(grpc.StatusCode, e.code), str(e))
        except ValueError as e:  # SamplingParams
            self._refuse(context, method, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        # Runs when the RPC ends for any reason; aborting a finished request is a no-op.
        context.add_callback(handle.abort)
        rid, m = handle.request_id, self.metrics
        last = None
        while True:
            try:
                ev = handle.get(timeout=_POLL_S)
            except queue.Empty:
                if not context.is_active():
                    handle.abort()
                    m.requests.labels(method, "cancelled").inc()
                    return
                continue
            batch = [ev]
            while not isinstance(batch[-1], FinishEvent):  # coalesce what is already there into one message
                try:
                    batch.append(handle.get(timeout=0))
                except queue.Empty:
                    break
            tokens = [e for e in batch if isinstance(e, TokenEvent)]
            now = time.perf_counter()
            if tokens and last is not None:  # tokens that arrived together share the gap since the last ones
                for _ in tokens:
                    m.itl.labels(method).observe((now - last) / len(tokens))
            if tokens:
                last = now
            if tokens:
                m.generation_tokens.labels(method).inc(len(tokens))
                yield pb.GenerateResponse(request_id=rid, delta=pb.TokenDelta(
                    token_ids=[e.token_id for e in tokens], text="".join(e.text for e in tokens)))
            fin = batch[-1]
            if isinstance(fin, FinishEvent):
                yield self._finish(fin, method, time.perf_counter() - t0)
                return

    def _finish(self, fin: FinishEvent, method: str, e2e: float) -> pb.GenerateResponse:
        m = self.metrics
        m.requests.labels(method, fin.finish_reason).inc()
        m.prompt_tokens.labels(method).inc(fin.prompt_tokens)
        if fin.token_ids:
            m.ttft.labels(method).observe(fin.ttft_s)
        m.e2e.labels(method).observe(e2e)
        return pb.GenerateResponse(request_id=fin.request_id, finish=pb.Finish(
            finish_reason=fin.finish_reason,
            usage=pb.Usage(prompt_tokens=fin.prompt_tokens, completion_tokens=len(fin.token_ids)),
            timings=pb.Timings(ttft_s=fin.ttft_s, decode_s=fin.decode_s, e2e_s=e2e),
            text=fin.text, error=fin.error, replica=int(fin.stats.get("replica", 0)),
            density=finish_density(fin), cached_tokens=int(fin.stats.get("cached_tokens", 0))))

    def _refuse(self, context: grpc.ServicerContext, method: str, code: grpc.StatusCode, message: str) -> None:
        self.metrics.requests.labels(method, code.name.lower()).inc()
        context.abort(code, message)  # raises

    # ---- unary calls --------------------------------------------------------------------------------
    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        _refuse_undecodable(request, context)
        if not request.request_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        return pb.AbortResponse(found=bool(self.engine.abort(request.request_id)))

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext) -> pb.ModelInfo:
        _refuse_undecodable(request, context)
        if getattr(self.engine, "model_cfg", None) is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine is {self.engine.state}")
        i = self.engine.model_info()
        return pb.ModelInfo(model=i["model"], layers=i["layers"], heads=i["heads"], kv_heads=i["kv_heads"],
                            head_dim=i["head_dim"], vocab_size=i["vocab_size"], max_positions=i["max_positions"],
                            dtype=i["dtype"], tp=i["tp"], replicas=i["replicas"], device=i["device"],
                            methods=list(i["methods"]), has_tokenizer=self.engine.tokenizer is not None)

    def GetServerInfo(self, request: pb.GetServerInfoRequest, context: grpc.ServicerContext) -> pb.ServerInfo:
        _refuse_undecodable(request, context)
        return server_info_to_proto(self.engine.server_info())


def _shard_load(load: dict[str, Any] | None) -> pb.ShardLoad | None:
    if not load:
        return None
    return pb.ShardLoad(**{k: load[k] for k in ("source", "bytes_read", "checkpoint_bytes", "host_peak_bytes",
                                                 "host_rss_before_bytes", "seconds")})


def server_info_to_proto(i: dict[str, Any]) -> pb.ServerInfo:
    reps = [pb.ReplicaInfo(index=r["index"], state=r["state"], running=r["running"], waiting=r["waiting"],
                           kv_used_tokens=r["kv_used_tokens"], kv_capacity_tokens=r["kv_capacity_tokens"],
                           steps=r.get("steps", 0), rebuilds=r.get("rebuilds", 0), last_error=r.get("last_error", ""),
                           shards=[pb.ShardInfo(name=s.get("name", ""), rank=s.get("rank", 0),
                                                node_id=str(s.get("node_id", "")), device=str(s.get("device", "")),
                                                load=_shard_load(s.get("load")))
                                   for s in r.get("shards", [])])
            for r in i.get("replicas", [])]
    return pb.ServerInfo(state=i["state"], serving=i["serving"], running=i["running"], waiting=i["waiting"],
                         kv_used_tokens=i["kv_used_tokens"], kv_capacity_tokens=i["kv_capacity_tokens"],
                         replicas=reps, tp=i.get("tp", 1))
