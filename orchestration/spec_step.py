"""SpecAttn in the engine: one draft actor per replica, rounds of draft-then-verify on the shard group.

A SpecAttn prefill runs on the shards and, on GPUs, at the same time on the draft actor (its own full-depth
prefill); on CPUs, where the draft shares the shards' cores, the draft copies the shards' prompt K/V after
their prefill instead (``DraftWorker.adopt_prefill``), and each round the K/V of the tokens they verified. A
decode step becomes a round: the draft actor proposes (``DraftWorker.propose``) and the shards verify
(``ShardExecutor.verify``). The shards receive the draft's message as an ObjectRef, so it travels from the
draft to the shards through Ray's object store without a hop through the driver, and the call reaches the
shards before the draft has finished. The draft gets a GPU of its own when the cluster has one to spare;
otherwise, on a GPU cluster, it shares a GPU with a shard (Ray does not hand that GPU to it, so it sees every
GPU of its node and takes the first); on CPU it is a process of its own.
"""

from __future__ import annotations

import time
from typing import Any

from raysparse.actors.draft_worker import DraftWorker
from raysparse.actors.shard_worker import ShardSpec
from raysparse.methods.registry import method_capabilities
from raysparse.step_plan import StepPlan, parse_key


class SpecStep:
    def __init__(self, runner: Any, spec: ShardSpec, use_gpu: bool, prefix: str, runtime_env: dict | None = None,
                 draft_model: str | None = None):
        self.runner, self.spec, self.use_gpu, self.prefix = runner, spec, use_gpu, prefix
        self.draft_model = draft_model
        self.runtime_env = runtime_env
        self.actor: Any = None
        self.name = ""
        self.generation = 0
        self.gammas: dict[str, int] = {}
        self.round_s = 0.0
        self.rounds = 0
        self.copies_kv = False

    def start(self, timeout_s: float = 600.0) -> None:
        import ray

        self.generation += 1
        gpu = 1 if self.use_gpu and ray.available_resources().get("GPU", 0) >= 1 else 0
        opts: dict[str, Any] = {"name": f"{self.prefix}-replica{self.runner.index}-draft-g{self.generation}",
                                "num_gpus": gpu, "max_restarts": 0,
                                # No CPU reserved: drafting and verification alternate, and a reservation
                                # would make a TP group that fills the machine wait forever for its draft.
                                "num_cpus": 0}
        env = dict(self.runtime_env or {})
        if self.use_gpu and not gpu:  # no GPU free: beside a shard, on a GPU Ray does not hand out to it
            env["env_vars"] = {**env.get("env_vars", {}), "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
        if env:
            opts["runtime_env"] = env
        # On CPUs every forward the draft runs to fill its cache takes the shards' cores: it copies the shards'
        # K/V instead, of the prompt (its own prefill's would be the same) and of the tokens verified each round
        # (``raysparse/kv_transfer.py``). On GPUs it runs them on its own device (or beside a shard), and the
        # prompt's prefill overlaps the shards' own.
        self.copies_kv = not self.use_gpu and self.draft_model is None
        self.actor = ray.remote(DraftWorker).options(**opts).remote(self.spec, self.draft_model)
        self.name = opts["name"]
        from raysparse.orchestration.replica import actor_id

        # the shards take the draft's messages as arguments: its death must be reported as the draft's
        self.runner.group.actor_names[actor_id(self.actor)] = f"draft actor {self.name}"
        ray.get(self.actor.setup.remote(), timeout=timeout_s)

    def stop(self) -> None:
        import ray

        if self.actor is not None:
            from raysparse.orchestration.replica import actor_id

            self.runner.group.actor_names.pop(actor_id(self.actor), None)
            try:
                ray.kill(self.actor, no_restart=True)
            except Exception:
                pass
            self.actor = None

    def check_alive(self, timeout_s: float = 10.0) -> None:
        """Raises ShardLostError when the draft actor died (a ping that times out is not a death)."""
        import ray

        from raysparse.orchestration.replica import ShardLostError, death_reason

        if self.actor is None:
            return
        try:
            ray.get(self.actor.ping.remote(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            return
        except ray.exceptions.RayActorError as e:
            raise ShardLostError(f"draft actor {self.name} of replica {self.runner.index} died: "
                                 f"{death_reason(e)}") from e

    def restart(self) -> None:
        self.stop()
        self.start()

    def handles(self, plan: StepPlan) -> bool:
        if not plan.key:
            return False
        if plan.key not in self.gammas:
            method, params = parse_key(plan.key)
            needs_draft = method_capabilities(method).needs_draft
            self.gammas[plan.key] = int(params.get("gamma", 4)) if needs_draft else 0
        return self.gammas[plan.key] > 0

    def run(self, runner: Any, plan: StepPlan) -> None:
        import ray

        from raysparse.orchestration.replica import ShardLostError

        t0 = time.perf_counter()
        free = list(plan.free)
        seqs = runner._seqs(plan)
        try:
            if plan.prefill:
                items = [(s.seq_id, s.request.max_tokens, list(s.request.prompt_ids)) for s in seqs]
                if self.copies_kv:  # the shards prefill alone, then the draft copies their K/V
                    res = runner.group.execute(plan)
                    if res["error"]:
                        self.free(free)
                    else:
                        parts = runner.group.submit("export_kv", [(sid, 0, len(p)) for sid, _, p in items])
                        ray.get(self.actor.adopt_prefill.remote(plan.key, items, free, *parts))
                else:
                    draft_ref = self.actor.prefill.remote(plan.key, items, free)
                    res = runner.group.execute(plan)
                    ray.get(draft_ref)
                new_tokens = None if res["error"] else [[t] for t in res["tokens"]]
            else:
                g = self.gammas[plan.key]
                items = []
                for s in seqs:
                    toks = list(s.request.prompt_ids) + s.tokens
                    items.append((s.seq_id, len(toks), toks[-(g + 2):],
                                  min(g, s.request.params.max_new_tokens - len(s.tokens))))
                parts = []
                if self.copies_kv:  # each shard's K/V of the tokens it verified last round (and a few before)
                    parts = runner.group.submit("export_kv", [(sid, max(0, n - 1 - (g + 1)), n - 1)
                                                              for sid, n, _, _ in items])
                msg_ref = self.actor.propose.remote(plan.key, items, free, *parts)
                results = runner.group._gather([a.verify.remote(plan, msg_ref) for a in runner.group.actors])
                res = results[0]
                errors = [r["error"] for r in results if r["error"]]
                res["error"] = errors[0] if errors else None
                new_tokens = res["tokens"]
        except ray.exceptions.RayActorError as e:  # the draft died: rebuild the replica like a lost shard
            from raysparse.orchestration.replica import death_reason

            raise ShardLostError(f"draft actor {self.name} of replica {runner.index} died: {death_reason(e)}") from e
        runner.steps += 1
        dt = time.perf_counter() - t0
        runner.step_wall_s += dt
        runner.step_forward_s += res.get("forward_s", 0.0)
        self.round_s += dt
        self.rounds += 1
        if res["error"]:
            self.free(plan.seq_ids)  # the shards freed them too; a retried prefill starts afresh
            runner._fail(plan, res["error"])
            return
        runner.emit(plan, new_tokens)

    def free(self, seq_ids: list[int]) -> None:
        if self.actor is not None and seq_ids:
            self.actor.free.remote(seq_ids)

    def stats(self) -> dict[str, Any]:
        import ray

        out = ray.get(self.actor.stats.remote(), timeout=60) if self.actor is not None else {}
        return {**out, "engine_rounds": self.rounds, "round_s": self.round_s}


def attach_spec_steps(engine: Any, spec: ShardSpec, draft_model: str | None = None) -> None:
    """One draft actor per replica, started now (each loads its own copy of the draft: the verifier's
    weights for the self-speculative draft, else the ``draft_model`` checkpoint)."""
    for runner in engine.runners:
        step = SpecStep(runner, spec, engine.use_gpu, engine.name, draft_model=draft_model)
        step.start(engine.cfg.load_timeout_s)
        runner.spec_step = step
