"""One replica's engine loop: schedule a step, run it on the shard group, turn sampled tokens into events.

The loop runs in its own thread. Everything the caller can touch (the scheduler, abort flags) is guarded
by ``cond``; the step itself runs outside the lock so submissions never wait for a forward pass.
A shard that dies fails this replica's running requests with a clear error, the group is rebuilt and
the requests still waiting are served by the new group. A request that had yielded no token yet when the
group died (waiting for pages, or part-way through its prompt) is retried once on the rebuilt group, so its
caller never sees the failure. While idle the loop checks every ``liveness_s`` that its shards (and draft)
are alive, so a dead actor is found - and the replica reported as rebuilding - before a request needs it.
Finish events carry errors as plain text: Ray's terminal colour codes are removed.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from raysparse.attention import causal_pairs
from raysparse.generate import FinishEvent, TokenEvent, text_delta
from raysparse.orchestration.replica import ReplicaGroup, ShardLostError, plain
from raysparse.orchestration.scheduler import Scheduler, Sequence
from raysparse.step_plan import StepPlan

log = logging.getLogger("raysparse.engine")

# what ``info`` (and so the server info) shows of each shard; ``load``: its ``LoadStats`` (bytes read, host memory)
SHARD_INFO_KEYS = ("name", "rank", "node_id", "device", "kv_heads", "load")


class ReplicaRunner:
    def __init__(self, index: int, group: ReplicaGroup, scheduler: Scheduler, tokenizer: Any | None,
                 spec_step: Any | None = None, liveness_s: float = 1.0) -> None:
        self.index, self.group, self.sched, self.tokenizer = index, group, scheduler, tokenizer
        self.liveness_s = liveness_s  # while idle: seconds between two checks that the actors are alive
        self._next_check = 0.0
        self.spec_step = spec_step  # SpecAttn rounds (draft actor + verification), when available
        self.cond = threading.Condition()
        self.state = "loading"  # loading | ready | rebuilding | stopped
        self.last_error = ""
        self._stop = False
        self.thread = threading.Thread(target=self._loop, name=f"raysparse-replica{index}", daemon=True)
        # control-plane accounting: driver round trip vs the shards' own forward time
        self.steps = 0
        self.step_wall_s = 0.0
        self.step_forward_s = 0.0
        self.rebuilds = 0

    # ---- called by the engine (any thread) ----------------------------------------------------
    def add(self, seq: Sequence) -> None:
        with self.cond:
            self.sched.add(seq)
            self.cond.notify()

    def abort(self, request_id: str) -> bool:
        with self.cond:
            for seq in self.sched.all_sequences():
                if seq.request.request_id == request_id:
                    if self.sched.drop_waiting(seq):
                        self._finish(seq, "abort")
                    else:
                        seq.aborted = True  # finished by the loop between steps
                    self.cond.notify()
                    return True
        return False

    def load(self) -> int:
        with self.cond:
            return sum(len(s.request.prompt_ids) + s.request.params.max_new_tokens for s in self.sched.all_sequences())

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            for seq in self.sched.all_sequences():
                self._finish(seq, "abort", "the engine is shutting down")
            self.cond.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout=30)
        self.group.stop()
        if self.spec_step is not None:
            self.spec_step.stop()
        self.state = "stopped"

    # ---- the loop ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            check = False
            with self.cond:
                while not self._stop and (self.state != "ready" or not self.sched.has_work()):
                    left = self._next_check - time.monotonic()
                    if self.state == "ready" and left <= 0:
                        check = True
                        break
                    self.cond.wait(min(0.5, max(0.01, left)))
                if self._stop:
                    return
                plan = None
                if not check:
                    for seq in self.sched.all_sequences():
                        if seq.aborted:
                            self._finish(seq, "abort")
                    plan = self.sched.next_plan()
            if check:
                self._check_alive()
                continue
            if plan is None:
                continue
            try:
                self._run(plan)
            except ShardLostError as e:
                self._rebuild(str(e))
            except Exception as e:  # an engine bug must not kill the loop: fail the step's requests
                log.exception("replica %d step failed", self.index)
                self._fail(plan, f"{type(e).__name__}: {e}")

    def _check_alive(self) -> None:
        """Idle: are the group's actors alive? A dead one starts the rebuild now, not at the next request."""
        self._next_check = time.monotonic() + self.liveness_s
        try:
            for part in (self.group, self.spec_step):
                check = getattr(part, "check_alive", None)
                if check is not None:
                    check()
        except ShardLostError as e:
            self._rebuild(str(e))
        except Exception as e:  # noqa: BLE001 - a failed check is no verdict; the next step will tell
            log.warning("replica %d: liveness check failed: %s", self.index, plain(str(e)).splitlines()[0])

    def _run(self, plan: StepPlan) -> None:
        if self.spec_step is not None:
            if plan.seq_ids and self.spec_step.handles(plan):
                self.spec_step.run(self, plan)
                return
            self.spec_step.free(plan.free)  # the draft holds a copy of every SpecAttn sequence
        if not plan.seq_ids:
            self.group.execute(plan)
            return
        t0 = time.perf_counter()
        res = self.group.execute(plan)
        self.steps += 1
        self.step_wall_s += time.perf_counter() - t0
        self.step_forward_s += res.get("forward_s", 0.0)
        log.debug("replica %d step: %s %d seqs %d tokens, wall %.4f s, forward %.4f s", self.index,
                  "prefill" if plan.prefill else "decode", len(plan.seq_ids), sum(map(len, plan.tokens)),
                  time.perf_counter() - t0, res.get("forward_s", 0.0))
        if res["error"]:
            self._fail(plan, res["error"])
            return
        if plan.prefill:
            with self.cond:
                self.sched.prefill_succeeded(plan)  # its prompts' full pages may serve later prompts now
        if res.get("meter"):
            self.account_density(plan, res["meter"])
        self.emit(plan, res["tokens"] if plan.steps > 1 else [[t] for t in res["tokens"]], res.get("logprobs"),
                  res.get("prompt_logprobs"))

    def emit(self, plan: StepPlan, new_tokens: list[list[int]], logprobs: dict[int, list[Any]] | None = None,
             prompt_logprobs: dict[int, list[Any]] | None = None) -> None:
        """Delivers each sequence's new tokens (one per step, several per SpecAttn round) in order, with their
        log-probabilities where the request asked (the shards' ``logprobs``, one entry per token sampled; a
        prompt chunk's ``prompt_logprobs`` are kept for the finish event)."""
        now = time.perf_counter()
        with self.cond:
            seqs = self._seqs(plan)
            for i, (seq, toks) in enumerate(zip(seqs, new_tokens, strict=True)):
                if seq is None:
                    continue
                if prompt_logprobs and seq.seq_id in prompt_logprobs:
                    if not seq.prompt_logprobs:
                        seq.prompt_logprobs.append(None)  # the first prompt token has nothing before it
                    seq.prompt_logprobs.extend(prompt_logprobs[seq.seq_id])
                if toks == [None]:  # a prompt's non-final chunk
                    continue
                if plan.prefill and i >= plan.decode_rows:  # a prompt's first token (not a mixed step's decode)
                    seq.t_first = now
                lps = (logprobs or {}).get(seq.seq_id) or [None] * len(toks)
                for tok, lp in zip(toks, lps, strict=False):
                    if self._accept(seq, tok, lp):
                        break

    def account_density(self, plan: StepPlan, counts: list[float]) -> None:
        """Shares a step's density-meter counts (rank 0's: prefill attended and causal pairs, then decode's)
        among its sequences in proportion to their causal pairs, so each request reports the density of the
        steps that served it (exact for a request alone in its steps)."""
        with self.cond:
            rows = [(s, toks) for s, toks in zip(self._seqs(plan), plan.tokens, strict=True) if s is not None]
            weights = []
            for i, (seq, toks) in enumerate(rows):
                if plan.prefill and i >= plan.decode_rows:  # this chunk's queries over the prompt up to its end
                    weights.append(causal_pairs(len(toks), seq.prefilled))
                else:
                    weights.append(len(seq.request.prompt_ids) + len(seq.tokens) + 1)
            total = sum(weights)
            for (seq, _), w in zip(rows, weights, strict=True):
                for i, c in enumerate(counts):
                    seq.meter[i] += c * w / total if total else 0.0

    def _seqs(self, plan: StepPlan) -> list[Sequence | None]:
        by_id = {s.seq_id: s for s in self.sched.running.get(plan.key, [])}
        return [by_id.get(sid) for sid in plan.seq_ids]

    def _accept(self, seq: Sequence, token: int, logprob: Any = None) -> bool:
        """Records one token (``logprob``: its (id, logprob, top alternatives), when asked for); returns True
        when the request finished."""
        p = seq.request.params
        if token in seq.stops:
            self._finish(seq, "stop")
            return True
        seq.tokens.append(token)
        lp, top = (float(logprob[1]), tuple(logprob[2])) if logprob is not None else (None, ())
        seq.handle.put(TokenEvent(seq.request.request_id, token, self._detok(seq), lp, top))
        if len(seq.tokens) >= p.max_new_tokens:
            self._finish(seq, "length")
            return True
        return False

    def _detok(self, seq: Sequence) -> str:
        delta, seq.text = text_delta(self.tokenizer, seq.tokens, seq.text)
        return delta

    def _finish(self, seq: Sequence, reason: str, error: str = "") -> None:
        self.sched.release(seq)
        now = time.perf_counter()
        ttft = (seq.t_first or now) - seq.t_submit
        seq.handle.put(FinishEvent(
            seq.request.request_id, reason, tuple(seq.tokens), seq.text, len(seq.request.prompt_ids), ttft,
            now - seq.t_first if seq.t_first else 0.0, plain(error),
            {"replica": self.index, "method": seq.request.method, "method_params": dict(seq.request.method_params),
             "density": request_density(seq.meter), "cached_tokens": seq.cached,
             **({"prompt_logprobs": list(seq.prompt_logprobs)} if seq.prompt_logprobs else {})}))

    def _fail(self, plan: StepPlan, error: str) -> None:
        with self.cond:
            # a mixed step's decode rows were rolled back on the shards: they run again in a later step
            seqs = [s for s in self._seqs(plan)[plan.decode_rows:] if s is not None]
            if plan.prefill and len(seqs) > 1:
                # Which request broke the batch is unknown: each is retried alone, so only it fails.
                for seq in reversed(seqs):
                    self.sched.requeue_alone(seq)
                self.cond.notify()
                return
            for seq in seqs:
                self._finish(seq, "error", error)

    def _rebuild(self, error: str) -> None:
        error = plain(error)
        log.error("replica %d: %s; rebuilding", self.index, error)
        with self.cond:
            self.state, self.last_error = "rebuilding", error
            retry = []
            for group in list(self.sched.running.values()):
                for seq in list(group):
                    if not seq.tokens and not seq.retried and not seq.aborted:
                        retry.append(seq)  # its caller saw nothing yet: it starts afresh on the new group
                    else:
                        self._finish(seq, "error", error)
            self.sched.requeue_lost(sorted(retry, key=lambda s: s.seq_id))
            self.sched.reset()
        self.group.stop()
        while not self._stop:
            try:
                self.group.start()
                if self.spec_step is not None:
                    self.spec_step.restart()
                break
            except Exception as e:  # e.g. the cluster lost the node: keep trying, the engine reports it
                log.error("replica %d rebuild failed: %s", self.index, e)
                self.group.stop()
                time.sleep(2.0)
        with self.cond:
            self.rebuilds += 1
            self.state = "ready" if not self._stop else "stopped"
            self.cond.notify_all()

    def prefix_info(self) -> dict[str, Any]:
        """The replica's prefix cache: on or off, pages cached, prompt tokens looked up and found, evictions."""
        pool = self.sched.pool
        return {"enabled": pool.config.enabled, "cached_pages": pool.cached_pages,
                "queried_tokens": pool.stats.queried_tokens, "hit_tokens": pool.stats.hit_tokens,
                "hit_rate": pool.stats.hit_rate, "evicted_pages": pool.stats.evicted_pages}

    def info(self) -> dict[str, Any]:
        with self.cond:
            running = self.sched.num_running()
            waiting = len(self.sched.waiting)
            used = self.sched.cfg.capacity_pages - self.sched.free_pages
        return {"index": self.index, "state": self.state, "running": running, "waiting": waiting,
                "kv_used_tokens": used * self.sched.cfg.page_size,
                "kv_capacity_tokens": self.sched.cfg.capacity_pages * self.sched.cfg.page_size,
                "steps": self.steps, "step_wall_s": self.step_wall_s, "step_forward_s": self.step_forward_s,
                "rebuilds": self.rebuilds, "last_error": self.last_error, "prefix_cache": self.prefix_info(),
                "shards": [{k: v for k, v in i.items() if k in SHARD_INFO_KEYS} for i in self.group.info]}


def request_density(meter: list[float]) -> dict[str, float | None]:
    """A request's prefill and decode density from its share of the meter (None: no such steps metered)."""
    pa, pc, da, dc = meter
    return {"prefill": pa / pc if pc > 0 else None, "decode": da / dc if dc > 0 else None}
