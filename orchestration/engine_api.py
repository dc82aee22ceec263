"""What callers of the engine see: the request, its event stream, and the errors with their meaning.

Each error class maps to one gRPC status code (``code``) so every front end answers the same way:
bad input is INVALID_ARGUMENT, a request that can never fit the KV cache (or a full queue) is
RESOURCE_EXHAUSTED, a request id that is already in flight is ALREADY_EXISTS, and an engine that is
loading, rebuilding, draining or stopped is UNAVAILABLE.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from raysparse.generate import FinishEvent, TokenEvent
from raysparse.sampling import SamplingParams

Event = TokenEvent | FinishEvent


class EngineError(Exception):
    code = "INTERNAL"


class InvalidRequestError(EngineError, ValueError):
    code = "INVALID_ARGUMENT"


class CapacityExceededError(EngineError):
    code = "RESOURCE_EXHAUSTED"


class RequestTooLargeError(CapacityExceededError):
    """The request can never fit a replica's KV cache (unlike a full queue, waiting will not help):
    RESOURCE_EXHAUSTED on gRPC, 400 on the OpenAI-compatible HTTP API."""


class EngineUnavailableError(EngineError):
    code = "UNAVAILABLE"


class DuplicateRequestError(EngineError):
    """A request id names at most one request in flight: abort by id must reach exactly that one."""

    code = "ALREADY_EXISTS"


_ids = itertools.count()


def new_request_id() -> str:
    return f"req-{time.time_ns():x}-{next(_ids)}"


@dataclass(frozen=True)
class EngineRequest:
    """One generation request. ``method_params`` are the method's config fields (e.g. ``density``)."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams = SamplingParams()
    method: str = "dense"
    method_params: tuple[tuple[str, Any], ...] = ()
    request_id: str = field(default_factory=new_request_id)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))
        if isinstance(self.method_params, Mapping):
            object.__setattr__(self, "method_params", tuple(sorted(self.method_params.items())))
        if not self.prompt_ids:
            raise InvalidRequestError("prompt is empty")
        if any(not isinstance(t, int) or t < 0 for t in self.prompt_ids):
            raise InvalidRequestError("prompt token ids must be non-negative integers")
        if not isinstance(self.method, str) or not self.method:
            raise InvalidRequestError("method must be a non-empty string")
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRequestError("request_id must be a non-empty string")

    @property
    def max_tokens(self) -> int:
        """KV tokens the request reserves: prompt plus every token it may generate."""
        return len(self.prompt_ids) + self.params.max_new_tokens


class RequestHandle:
    """The caller's end of one request: iterate it for events (token events, then exactly one finish event).

    Thread-safe; events are buffered, so a slow consumer never blocks the engine. ``abort`` asks the
    engine to stop the request; its finish event then has reason ``abort``."""

    def __init__(self, request: EngineRequest, on_abort: Callable[[str], Any],
                 on_finish: Callable[[RequestHandle], Any] | None = None) -> None:
        self.request = request
        self._q: queue.Queue[Event] = queue.Queue()
        self._on_abort = on_abort
        self._on_finish = on_finish  # the engine frees the request id here
        self.finished = threading.Event()
        self.started = threading.Event()  # the first event came: the prompt is prefilled (or the request ended)
        self.finish: FinishEvent | None = None
        self._listeners: list[Callable[[Event], Any]] = []
        # set by a front end that ends the request itself for a reason of its own (a stop string matched on
        # the text: "stop") before it aborts it; the metrics count that reason instead of "abort"
        self.finish_reason_hint: str | None = None

    def add_listener(self, fn: Callable[[Event], Any]) -> None:
        """Calls ``fn(event)`` after every event is queued, on the engine's thread: it must be quick and must
        not raise (asyncio front ends wake their loop with it; metrics time the tokens)."""
        self._listeners.append(fn)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def put(self, ev: Event) -> None:
        if self.finished.is_set():
            return  # one finish per request, nothing after it
        if isinstance(ev, FinishEvent):
            self.finish = ev
            self.finished.set()
            if self._on_finish is not None:
                self._on_finish(self)
        self._q.put(ev)
        self.started.set()
        for fn in self._listeners:
            try:
                fn(ev)
            except Exception:  # a listener's bug must not stop the replica's loop that delivers the event
                logging.getLogger("raysparse.engine").exception("request listener failed")

    def get(self, timeout: float | None = None) -> Event:
        """The next event; raises ``queue.Empty`` after ``timeout`` seconds without one."""
        return self._q.get(timeout=timeout)

    def __iter__(self) -> Iterator[Event]:
        while True:
            ev = self._q.get()
            yield ev
            if isinstance(ev, FinishEvent):
                return

    def abort(self) -> None:
        # A finished request has nothing left to stop, and its id may already name a newer request.
        if not self.finished.is_set():
            self._on_abort(self.request_id)

    def result(self, timeout: float | None = None) -> FinishEvent:
        """Blocks until the request finishes and returns its finish event."""
        if not self.finished.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish in {timeout} s")
        assert self.finish is not None
        return self.finish
