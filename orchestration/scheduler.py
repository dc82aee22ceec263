"""Continuous batching for one replica: admission against KV pages, then prefill and decode steps.

Policy (as in vLLM's first scheduler, per method key): waiting requests are admitted FIFO when their
whole reservation (prompt + max new tokens) fits the free pages; a prefill step packs admitted prompts
of the head request's method up to ``max_prefill_tokens``; decode steps batch up to ``max_batch`` running
sequences of one method key, rotating over keys. When both kinds of work exist the steps alternate, so
a stream of arrivals never starves running decodes. A request whose reservation exceeds the whole cache
is refused at submission (``CapacityExceededError``), never out of memory later. What a method allows
(chunked prefill, several decode steps per call, a cached prefix) comes from its registry entry
(``MethodCapabilities``).

With ``--kv-offload`` the pages are the host tier's and a device pool per shard caches the hot ones: admission
also counts the device pool's pages, each running sequence holding its pinned sink and window pages there.

Pages are the scheduler's (``PagePool``): it picks each admitted sequence's physical pages, and with the
prefix cache a prompt whose leading full pages are cached starts after them, sharing those pages; only
its new pages count against the free ones. Its prefilled full pages join the cache once a step succeeds.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from raysparse.methods.registry import MethodCapabilities, method_capabilities
from raysparse.orchestration.engine_api import CapacityExceededError, EngineRequest, RequestHandle, RequestTooLargeError
from raysparse.orchestration.prefix_cache import PagePool, PrefixCacheConfig, page_keys
from raysparse.step_plan import StepPlan, parse_key


@dataclass
class Sequence:
    """The driver's view of one request in a replica."""

    handle: RequestHandle
    seq_id: int
    key: str
    pages: int
    stops: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    t_submit: float = 0.0
    t_first: float = 0.0
    aborted: bool = False
    solo: bool = False  # prefill alone: a batch it was in failed, and the culprit is not known yet
    prefilled: int = 0  # prompt tokens already sent to the shards (chunked prefill)
    # this request's share of the density meter's counts in its steps: prefill attended and causal pairs,
    # then decode's (``runner.account_density``)
    meter: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])
    retried: bool = False  # already requeued once after its group died
    keys: list[bytes] = field(default_factory=list)  # chained digests of the prompt's full pages (prefix cache)
    cached: int = 0  # prompt tokens found in the prefix cache at admission (not computed)
    # with ``SamplingParams.prompt_logprobs``: each prompt token's (id, logprob, top alternatives), the first's None
    prompt_logprobs: list[Any] = field(default_factory=list)

    @property
    def prompt_done(self) -> bool:
        return self.prefilled >= len(self.handle.request.prompt_ids)

    @property
    def request(self) -> EngineRequest:
        return self.handle.request


@dataclass(frozen=True)
class SchedulerConfig:
    capacity_pages: int
    page_size: int
    max_batch: int = 64
    max_prefill_tokens: int = 65536
    max_waiting: int = 4096
    decode_steps: int = 1  # consecutive decode steps per plan while no prompt can be admitted or continued
    prefix: PrefixCacheConfig = PrefixCacheConfig()
    # The head prompt's tokens in one step while nothing decodes (None: max_prefill_tokens): chunks exist to keep
    # decodes flowing; with none, a chunk only adds the method's per-step work (a sparse method's selection).
    idle_prefill_tokens: int | None = None
    # With ``--kv-offload``: the device pool's pages per layer, and the pages each running sequence pins in it (its
    # sinks and window). ``capacity_pages`` is then the host tier's, which holds every sequence's whole K/V; the
    # device pool must hold the running sequences' pinned pages (what the rest of a step reads is fetched into what
    # is left, or staged). None: one tier.
    device_pages: int | None = None
    pinned_pages: int = 0

    def __post_init__(self) -> None:
        for name in ("capacity_pages", "page_size", "max_batch", "max_prefill_tokens", "max_waiting",
                     "decode_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.idle_prefill_tokens is not None and not self.idle_prefill_tokens >= self.max_prefill_tokens > 0:
            raise ValueError(f"idle_prefill_tokens must be at least max_prefill_tokens, got {self.idle_prefill_tokens}")
        if self.device_pages is not None and not self.device_pages > self.pinned_pages >= 0:
            raise ValueError(f"device_pages ({self.device_pages}) must exceed one sequence's pinned pages "
                             f"({self.pinned_pages})")

    def device_seqs(self) -> int | None:
        """Sequences whose pinned pages the device pool holds at once (None: no device pool, no such bound)."""
        if self.device_pages is None:
            return None
        return self.device_pages // max(1, self.pinned_pages)


class Scheduler:
    _seq_ids = itertools.count()

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.pool = PagePool(cfg.capacity_pages, cfg.page_size, cfg.prefix)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, list[Sequence]] = {}
        self._to_free: list[int] = []
        self._rr = 0
        self._last_prefill = False
        self._caps: dict[str, MethodCapabilities] = {}

    def capabilities(self, key: str) -> MethodCapabilities:
        """What the method of ``key`` allows, looked up once per key. The engine validated the method at
        submission; a key that names no registered method (a bare policy key) gets the defaults."""
        caps = self._caps.get(key)
        if caps is None:
            try:
                caps = method_capabilities(parse_key(key)[0])
            except (ValueError, TypeError):
                caps = MethodCapabilities()
            self._caps[key] = caps
        return caps

    @property
    def free_pages(self) -> int:
        return self.pool.free_pages

    def prefix_reusable(self, key: str) -> bool:
        """Whether prompts of ``key`` may start from cached pages: the method allows it, and its blocks are
        the cache's pages (the per-page state a method keeps for a prefix is kept per block)."""
        try:
            block = parse_key(key)[1].get("block_size", self.cfg.page_size)
        except (ValueError, TypeError):
            return False
        return self.capabilities(key).prefix_cache and block == self.cfg.page_size

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.cfg.page_size)

    def make_sequence(self, handle: RequestHandle, key: str, stops: frozenset[int], now: float) -> Sequence:
        pages = self.pages_for(handle.request.max_tokens)
        if pages > self.cfg.capacity_pages:
            raise RequestTooLargeError(
                f"request needs {handle.request.max_tokens} KV tokens but a replica holds at most "
                f"{self.cfg.capacity_pages * self.cfg.page_size}")
        if len(self.waiting) >= self.cfg.max_waiting:
            raise CapacityExceededError(f"{len(self.waiting)} requests are already waiting")
        seq = Sequence(handle, next(self._seq_ids), key, pages, stops, t_submit=now)
        # a prompt whose log-probabilities are asked for is computed whole: a cached prefix has none
        if self.cfg.prefix.enabled and self.prefix_reusable(key) and handle.request.params.prompt_logprobs is None:
            seq.keys = page_keys(key, handle.request.prompt_ids, self.cfg.page_size)
        return seq

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self._to_free or any(self.running.values()))

    def num_running(self) -> int:
        return sum(len(v) for v in self.running.values())

    def release(self, seq: Sequence) -> None:
        """A running sequence finished: its pages come back once the shards were told (next plan)."""
        group = self.running.get(seq.key, [])
        if seq in group:
            group.remove(seq)
            self._to_free.append(seq.seq_id)
            self.pool.free(seq.seq_id)

    def requeue_alone(self, seq: Sequence) -> None:
        """A running sequence whose batched prefill failed goes back to the front of the queue, to be
        prefilled on its own (the shards already freed it), so one bad request fails alone."""
        group = self.running.get(seq.key, [])
        if seq in group:
            group.remove(seq)
            self.pool.free(seq.seq_id)
        seq.solo, seq.tokens, seq.text, seq.t_first, seq.prefilled, seq.cached = True, [], "", 0.0, 0, 0
        seq.prompt_logprobs = []
        self.waiting.appendleft(seq)

    def requeue_lost(self, seqs: list[Sequence]) -> None:
        """Running sequences whose group died before they yielded a token go back to the front of the queue,
        in their order, to start afresh on the rebuilt group (once: ``retried``)."""
        for seq in reversed(seqs):
            group = self.running.get(seq.key, [])
            if seq in group:
                group.remove(seq)
                self.pool.free(seq.seq_id)
            seq.retried, seq.tokens, seq.text, seq.t_first, seq.prefilled, seq.cached = True, [], "", 0.0, 0, 0
            seq.meter, seq.prompt_logprobs = [0.0, 0.0, 0.0, 0.0], []
            self.waiting.appendleft(seq)

    def drop_waiting(self, seq: Sequence) -> bool:
        try:
            self.waiting.remove(seq)
            return True
        except ValueError:
            return False

    def all_sequences(self) -> list[Sequence]:
        return list(self.waiting) + [s for g in self.running.values() for s in g]

    def reset(self) -> None:
        """After the replica's shards were lost: nothing runs, every page is free again and nothing is cached
        (the new shards' caches are empty)."""
        self.running.clear()
        self._to_free.clear()
        self.pool.reset()

    def prefill_succeeded(self, plan: StepPlan) -> None:
        """A prefill step's sequences hold their prompts up to ``prefilled`` now: their full pages are cached."""
        by_id = {s.seq_id: s for s in self.running.get(plan.key, [])}
        for sid in plan.seq_ids:
            seq = by_id.get(sid)
            if seq is not None and seq.keys:
                self.pool.register(sid, seq.keys, seq.prefilled)

    def _admissible(self, seq: Sequence, admitting: int = 0) -> bool:
        """Whether ``seq`` fits now, beside ``admitting`` others this step admits: its whole K/V in the (host)
        pages, and with a device pool its pinned pages beside every running sequence's."""
        held = self.cfg.device_seqs()
        if held is not None and self.num_running() + admitting + 1 > held:
            return False
        return self.pool.can_admit(seq.pages, seq.keys, len(seq.request.prompt_ids))

    def _ready(self, key: str) -> list[Sequence]:
        return [s for s in self.running.get(key, []) if s.prompt_done]

    def _partial(self) -> list[Sequence]:
        return [s for g in self.running.values() for s in g if not s.prompt_done]

    def _prefill_key(self) -> str:
        """The method key the next prefill step serves: the first part-way prompt's, else the head request's."""
        partial = self._partial()
        return partial[0].key if partial else self.waiting[0].key

    def next_plan(self) -> StepPlan | None:
        decode_keys = [k for k in self.running if self._ready(k)]
        admissible = bool(self.waiting) and self._admissible(self.waiting[0])
        if admissible or self._partial():
            key = self._prefill_key()
            mixed = self.capabilities(key).mixed_steps
            # decodes the prefill step does not carry (another key's, or all of them without mixed steps) get
            # every other step
            behind = [k for k in decode_keys if not (mixed and k == key)]
            if not (self._last_prefill and behind):
                self._last_prefill = True
                return self._prefill_plan(key, mixed)
        if decode_keys:
            self._last_prefill = False
            key = decode_keys[self._rr % len(decode_keys)]
            self._rr += 1
            group = self._ready(key)[: self.cfg.max_batch]
            plan = StepPlan(key, False, [s.seq_id for s in group], [[s.tokens[-1]] for s in group])
            if not (admissible or self._partial()) and self.capabilities(key).multi_step_decode:
                # Multi-step: fewer round trips while nothing else could run; never past a request's
                # max_new_tokens (its pages), at most steps - 1 tokens computed after a stop token.
                left = min(s.request.params.max_new_tokens - len(s.tokens) for s in group)
                plan.steps = max(1, min(self.cfg.decode_steps, left))
        elif self._to_free:
            plan = StepPlan("", False)
        else:
            return None
        plan.free, self._to_free = self._to_free, []
        return plan

    def _prefill_plan(self, key: str, mixed: bool) -> StepPlan:
        """Prompts (or their next chunks) up to ``max_prefill_tokens``: sequences part-way through their prompt
        first, then new admissions of the same method. A prompt longer than what is left of the step's budget
        is split (chunked prefill), so a long prompt never holds decodes up for more than one budget's worth;
        a method without ``chunked_prefill`` (e.g. one whose draft prefills whole prompts) is never split.
        While nothing decodes, the head prompt alone may take ``idle_prefill_tokens`` (the rest wait a step).
        With ``mixed`` (the method's ``mixed_steps``) the key's running sequences decode in the same step, one
        token each, first in the plan and counted in its budget; a prompt retried alone (``solo``) runs alone."""
        partial = self._partial()
        chunkable = self.capabilities(key).chunked_prefill
        budget = self.cfg.max_prefill_tokens
        idle = self.cfg.idle_prefill_tokens
        if idle is not None and idle > budget and not any(self._ready(k) for k in self.running):
            head = partial[0] if partial else self.waiting[0]  # its tokens left: past its prefill or cached prefix
            plen = len(head.request.prompt_ids)
            budget = max(budget, min(idle, plen - (head.prefilled if partial else
                                                   self.pool.hits(head.keys, plen) * self.cfg.page_size)))
        rows: list[tuple[Sequence, int]] = []  # (sequence, tokens of it in this step)
        head = partial[0] if partial else self.waiting[0]
        riding = self._ready(key)[: self.cfg.max_batch - 1] if mixed and not head.solo else []
        budget = max(1, budget - len(riding))  # a prompt token at least: the step is a prefill step
        for seq in [s for s in partial if s.key == key]:
            if budget <= 0 or len(riding) + len(rows) >= self.cfg.max_batch:
                break
            n = min(len(seq.request.prompt_ids) - seq.prefilled, budget)
            rows.append((seq, n))
            budget -= n
        admitted: list[Sequence] = []
        solo = any(s.solo for s, _ in rows)
        # pages being computed now (partial prompts, and the prompts admitted below): a prompt whose next page
        # is one of them waits for it rather than computing it a second time
        page = self.cfg.page_size
        inflight = {k for s in partial for k in s.keys[s.prefilled // page:]}
        for seq in list(self.waiting):
            if seq.key != key:
                continue
            plen = len(seq.request.prompt_ids)
            hit = self.pool.hits(seq.keys, plen)
            if hit < min(len(seq.keys), (plen - 1) // page) and seq.keys[hit] in inflight:
                continue
            if budget <= 0 or len(riding) + len(rows) >= self.cfg.max_batch or solo or (rows and seq.solo):
                break
            if not self._admissible(seq, len(admitted)):
                break  # FIFO within the key: no overtaking a request that waits for pages
            left = plen - hit * page
            if not chunkable and rows and left > budget:
                break
            n = left if not chunkable else min(left, budget)
            rows.append((seq, n))
            admitted.append(seq)
            budget -= n
            solo = seq.solo
            _, seq.cached = self.pool.allocate(seq.seq_id, seq.pages, seq.keys, plen)
            seq.prefilled = seq.cached
            inflight.update(seq.keys[hit:])
            self.waiting.remove(seq)
        self.running.setdefault(key, []).extend(admitted)
        plan = StepPlan(key, True, admit=[(s.seq_id, s.request.max_tokens, _params_dict(s),
                                           self.pool.pages_of(s.seq_id), s.cached) for s in admitted])
        if rows:  # a mixed step's decode rows ride only with a prompt's tokens
            plan.decode_rows = len(riding)
            plan.seq_ids = [s.seq_id for s in riding]
            plan.tokens = [[s.tokens[-1]] for s in riding]
            plan.sample = [True] * len(riding)
        for seq, n in rows:
            plan.seq_ids.append(seq.seq_id)
            plan.tokens.append(list(seq.request.prompt_ids[seq.prefilled: seq.prefilled + n]))
            seq.prefilled += n
            plan.sample.append(seq.prompt_done)  # only a prompt's last chunk yields a token
        plan.free, self._to_free = self._to_free, []
        return plan


def _params_dict(seq: Sequence) -> dict[str, Any]:
    return asdict(seq.request.params)
