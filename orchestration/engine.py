"""The engine: replicas of tensor-parallel shard groups on Ray, request routing, admission and abort.

``Engine.start`` joins Ray (or starts a local instance), builds ``replicas`` groups of ``tp`` shard actors
(each group pinned to one node, the groups spread over the nodes: ``engine_replicas``) and one loop thread
per group (``runner.ReplicaRunner``). ``submit`` validates a request completely before it is queued -
method and parameters (each value of its config field's type: a bool is not a number, null is not a value),
sampling values, positions, KV capacity - so a bad request is refused with a typed
error (``engine_api``) and never reaches a shard. Requests go to the ready replica with the least queued work.

Text prompts (``encode``) are measured in bytes before they are tokenized: a text longer than the model's
positions times the vocabulary's longest token can never fit, and is refused at once. Tokenizing runs on
one thread of its own, never on a caller's: however many large prompts arrive together, they take one core
at most and queue there, while the replicas' loops and the other streams go on.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from raysparse.actors.shard_worker import ShardSpec
from raysparse.config import ModelConfig
from raysparse.orchestration.engine_api import (
    CapacityExceededError,
    DuplicateRequestError,
    EngineRequest,
    EngineUnavailableError,
    InvalidRequestError,
    RequestHandle,
)
from raysparse.orchestration.engine_config import EngineConfig
from raysparse.orchestration.engine_replicas import replica_runners, shard_threads
from raysparse.orchestration.parallel import run_in_parallel
from raysparse.orchestration.runner import ReplicaRunner
from raysparse.step_plan import method_key

log = logging.getLogger("raysparse.engine")


class Engine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.state = "created"  # created | loading | ready | draining | stopped
        self.runners: list[ReplicaRunner] = []
        self.tokenizer: Any = None
        self.model_cfg: ModelConfig | None = None
        self.eos: frozenset[int] = frozenset()
        self._owns_ray = False
        self._methods_ok: dict[str, str] = {}  # method key -> "" (valid) or the error
        self._method_probe: dict[str, Any] = {}  # method key -> a backend of it, for per-request checks
        self.source_name = ""
        self.use_gpu = False
        self.name = cfg.name or f"raysparse-{uuid.uuid4().hex[:6]}"
        # Requests in flight by id. An id is taken from submission until the request's finish event, so
        # abort by id reaches one request only. Lock order: _id_lock, then a runner's cond, then
        # _inflight_lock (taken by a finishing request while its runner holds cond, so never held around
        # a call into a runner).
        self._inflight: dict[str, RequestHandle] = {}
        self._inflight_lock = threading.Lock()
        self._id_lock = threading.Lock()  # taking an id and aborting by id, one at a time
        self._observers: list[Callable[[RequestHandle], Any]] = []
        self.max_prompt_bytes = 0  # set at start from the tokenizer (0: no tokenizer, no limit needed)
        self._tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="raysparse-tokenizer")

    def add_request_observer(self, fn: Callable[[RequestHandle], Any]) -> None:
        """Calls ``fn(handle)`` for every accepted request before its first event (whatever front end sent
        it), e.g. to attach a listener that times its tokens (``serving.engine_metrics``). Must be quick."""
        self._observers.append(fn)

    # ---- life cycle -------------------------------------------------------------------------------
    def start(self) -> Engine:
        import ray

        from raysparse.loader import load_hf_config, load_tokenizer, materialize, resolve_source
        from raysparse.orchestration.ray_env import local_instance, start_ray

        self.state = "loading"
        self._owns_ray = start_ray(self.cfg.address, self.cfg.num_cpus)
        try:
            src = resolve_source(self.cfg.model)
            self.source_name = src.name
            if src.gguf_file is not None:  # convert once here, not once per shard
                src = materialize(src)
            hf_config = load_hf_config(src)
            if self.cfg.draft_model is not None:  # refused before any actor starts
                from raysparse.specattn.draft_model import check_draft_paths

                check_draft_paths(str(src.directory), self.cfg.draft_model)
            self.model_cfg = ModelConfig.from_hf(hf_config)
            try:
                self.tokenizer = load_tokenizer(src)
            except Exception as e:  # e.g. a config-only directory: the engine then takes and returns ids only
                log.warning("no tokenizer for %s (%s): token ids only", src.name, str(e).splitlines()[0])
            if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
                self.eos = frozenset({int(self.tokenizer.eos_token_id)})
            if self.tokenizer is not None:
                self.max_prompt_bytes = prompt_byte_limit(self.tokenizer, self.model_cfg.max_position_embeddings)
            gpus = ray.cluster_resources().get("GPU", 0)
            self.use_gpu = self.cfg.device == "cuda" or (self.cfg.device == "auto" and gpus >= self.cfg.tp)
            spec = ShardSpec(str(src.directory), self.cfg.dtype, self.cfg.kv_cache_tokens, self.cfg.page_size,
                             self.cfg.random_weights, self.cfg.seed,
                             num_threads=shard_threads(self.cfg, self.use_gpu, local_instance()),
                             cuda_graphs=self.cfg.cuda_graphs, max_batch=self.cfg.max_batch, runtime=self.cfg.runtime,
                             kv_offload=self.cfg.kv_offload)
            # appended one by one: a failure part way leaves the runners built so far to ``shutdown``
            for runner in replica_runners(self.cfg, spec, self.use_gpu, self.tokenizer, self.name):
                self.runners.append(runner)
            # Side by side, and a signal during the load stops it at once (``parallel``'s docstring).
            run_in_parallel([lambda r=r: r.group.start(self.cfg.load_timeout_s) for r in self.runners],
                            "raysparse-start")
            from raysparse.orchestration.spec_step import attach_spec_steps

            if self.cfg.draft:
                attach_spec_steps(self, spec, self.cfg.draft_model)
            for r in self.runners:
                r.state = "ready"
                r.thread.start()
            self.state = "ready"
            return self
        except BaseException:
            self.shutdown()
            raise

    def drain(self) -> None:
        """Refuses new requests (UNAVAILABLE) while the ones in flight go on; ``shutdown`` ends them."""
        if self.state == "ready":
            self.state = "draining"

    def shutdown(self) -> None:
        """Stops the replicas, then the local Ray instance the engine started (every process of it).
        Idempotent, and safe to call again when an exception (a signal) cut an earlier call short."""
        if self.state != "stopped":
            self.state = "draining"
            for r in self.runners:
                r.stop()
            self._tokenize.shutdown(wait=False, cancel_futures=True)
            self.state = "stopped"
        if self._owns_ray:
            from raysparse.orchestration.ray_env import stop_ray

            stop_ray()
            self._owns_ray = False

    def __enter__(self) -> Engine:
        return self.start() if self.state == "created" else self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- requests ------------------------------------------------------------------------------------
    def validate(self, req: EngineRequest) -> str:
        """Raises InvalidRequestError for anything the engine would refuse; returns the method key."""
        from raysparse.methods.registry import check_param_values, create_backend, method_capabilities

        assert self.model_cfg is not None
        limit = self.model_cfg.max_position_embeddings
        if req.max_tokens > limit:
            raise InvalidRequestError(f"prompt ({len(req.prompt_ids)} tokens) plus max_new_tokens "
                                      f"({req.params.max_new_tokens}) exceeds the model's {limit} positions")
        if max(req.prompt_ids) >= self.model_cfg.vocab_size:
            raise InvalidRequestError(f"token id {max(req.prompt_ids)} is outside the vocabulary "
                                      f"({self.model_cfg.vocab_size})")
        try:  # every parameter's value has its field's type before it reaches a config (or a key)
            check_param_values(req.method, dict(req.method_params))
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        key = method_key(req.method, req.method_params)
        if key not in self._methods_ok:
            try:
                self._method_probe[key] = create_backend(req.method, self.model_cfg, **dict(req.method_params))
                err = ""
                if method_capabilities(req.method).needs_draft and not self.cfg.draft:
                    err = f"{req.method} needs the draft actor, which this engine was started without"
            except (ValueError, TypeError) as e:
                err = str(e)
            self._methods_ok[key] = err
        if self._methods_ok[key]:
            raise InvalidRequestError(self._methods_ok[key])
        # A prompt too short for its density (the sink, local and diagonal blocks alone exceed the budget) is
        # served, not refused: it attends those, and reports the density it really had. ``check_request``
        # tells the eval, which compares settings at a density, where one cannot be met.
        caps = method_capabilities(req.method)
        if caps.greedy_only and not req.params.greedy:
            raise InvalidRequestError(f"{req.method} decodes greedily: temperature must be 0")
        p = req.params
        if caps.needs_draft and (p.logprobs is not None or p.prompt_logprobs is not None or p.penalized):
            raise InvalidRequestError(f"{req.method}'s rounds report no log-probabilities and take no penalties")
        if caps.engine_greedy_only and not req.params.greedy:
            raise InvalidRequestError(f"{req.method} samples only in-process; the engine's rounds accept greedily: "
                                      "temperature must be 0")
        return key

    def submit(self, req: EngineRequest) -> RequestHandle:
        if self.state != "ready":
            raise EngineUnavailableError(f"the engine is {self.state}")
        key = self.validate(req)
        ready = [r for r in self.runners if r.state == "ready"]
        if not ready:
            raise EngineUnavailableError("no replica is ready (rebuilding after a failure)")
        runner = min(ready, key=lambda r: r.load())
        handle = RequestHandle(req, lambda _rid: self._abort_handle(handle), self._forget)
        stops = frozenset(req.params.stop_token_ids) | (frozenset() if req.params.ignore_eos else self.eos)
        seq = runner.sched.make_sequence(handle, key, stops, time.perf_counter())  # may raise CapacityExceeded
        with self._id_lock:
            with self._inflight_lock:
                if req.request_id in self._inflight:
                    raise DuplicateRequestError(f"request id {req.request_id!r} is already in flight")
                self._inflight[req.request_id] = handle
            for fn in self._observers:
                fn(handle)
            runner.add(seq)
        return handle

    def _forget(self, handle: RequestHandle) -> None:
        """The request finished (its runner released it first): its id is free again."""
        with self._inflight_lock:
            if self._inflight.get(handle.request_id) is handle:
                del self._inflight[handle.request_id]

    def _abort_handle(self, handle: RequestHandle) -> bool:
        """Aborts this request only: a newer request that reuses the id after it finished is untouched."""
        with self._id_lock:  # no other request can take the id while the runners look for it
            with self._inflight_lock:
                if self._inflight.get(handle.request_id) is not handle:
                    return False
            return any(r.abort(handle.request_id) for r in self.runners)

    def abort(self, request_id: str) -> bool:
        """Aborts the request in flight with this id; False when there is none."""
        with self._inflight_lock:
            handle = self._inflight.get(request_id)
        return handle is not None and self._abort_handle(handle)

    def encode(self, text: str, chat: bool = True) -> list[int]:
        """Token ids of a text prompt (through the chat template when ``chat``), tokenized on the engine's
        tokenizer thread. Raises InvalidRequestError, before tokenizing, for a text that cannot fit."""
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send token ids")
        size = len(text.encode("utf-8", "surrogatepass"))  # a lone surrogate is the tokenizer's to refuse
        if self.max_prompt_bytes and size > self.max_prompt_bytes:
            assert self.model_cfg is not None
            raise InvalidRequestError(
                f"prompt of {size} bytes can never fit the model's {self.model_cfg.max_position_embeddings} "
                f"positions (at most {self.max_prompt_bytes} bytes)")
        return self._tokenize.submit(self._encode, text, chat).result()

    def _encode(self, text: str, chat: bool) -> list[int]:
        if chat and getattr(self.tokenizer, "chat_template", None):
            from raysparse.generate import chat_prompt_ids

            return chat_prompt_ids(self.tokenizer, text)
        return self.tokenizer(text)["input_ids"]

    # ---- introspection -------------------------------------------------------------------------------
    def serving(self) -> bool:
        return self.state == "ready" and any(r.state == "ready" for r in self.runners)

    def server_info(self) -> dict[str, Any]:
        reps = [r.info() for r in self.runners]
        return {"state": self.state, "serving": self.serving(), "tp": self.cfg.tp, "replicas": reps,
                "running": sum(r["running"] for r in reps), "waiting": sum(r["waiting"] for r in reps),
                "kv_used_tokens": sum(r["kv_used_tokens"] for r in reps),
                "kv_capacity_tokens": sum(r["kv_capacity_tokens"] for r in reps)}

    def model_info(self) -> dict[str, Any]:
        from raysparse.methods.registry import method_names

        c = self.model_cfg
        assert c is not None
        return {"model": self.source_name, "layers": c.num_layers, "heads": c.num_heads, "kv_heads": c.num_kv_heads,
                "head_dim": c.head_dim, "vocab_size": c.vocab_size, "max_positions": c.max_position_embeddings,
                "dtype": self.cfg.dtype, "tp": self.cfg.tp, "replicas": self.cfg.replicas,
                "device": "cuda" if self.use_gpu else "cpu", "methods": method_names()}

    def shard_stats(self, reset: bool = False) -> list[list[dict[str, Any]]]:
        return [r.group.stats(reset) for r in self.runners if r.state == "ready"]


def prompt_byte_limit(tokenizer: Any, max_positions: int) -> int:
    """The most UTF-8 bytes a text may have and still fit ``max_positions`` tokens: no token covers more bytes
    of text than its own vocabulary entry spells (byte-level entries spell a byte as one character or more,
    SentencePiece spells a space as the 3-byte "\u2581", byte-fallback entries as "<0x41>"), so more bytes
    than positions times the longest entry always make more tokens than positions."""
    try:
        longest = max((len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab()), default=0)
    except Exception:  # noqa: BLE001 - a tokenizer without a readable vocabulary: no limit of this kind
        return 0
    return max_positions * max(longest, 4)


__all__ = ["CapacityExceededError", "DuplicateRequestError", "Engine", "EngineConfig", "EngineRequest",
           "EngineUnavailableError", "InvalidRequestError", "RequestHandle"]
