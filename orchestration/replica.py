"""One tensor-parallel group of shard actors: placement, rank order, process group, steps, rebuild.

A group's shards are placed with one placement group (PACK: every shard on one node when it fits,
pinned to the node chosen for this replica so replicas spread over the cluster's nodes). Ranks follow
the Ray node id, then the bundle index - never the IP, which several nodes on one host share.
A shard that dies surfaces as ``ShardLostError`` as soon as Ray reports it (the surviving shards, blocked
in a collective, are not waited for); ``stop`` then kills the rest and frees the placement group, and
``start`` builds a fresh group. ``check_alive`` pings every shard (the replica's loop calls it while idle).
The error names the actor that died - a shard, or another actor whose result a shard was waiting for (the
draft, registered in ``actor_names``) - with Ray's reason as plain text, without terminal escape codes.

Decode steps of GPU groups go through a Ray compiled graph over the shards' ``execute`` (shared-memory
channels: ~0.14 ms a round trip against ~1.2 ms for plain actor calls, ``benchmarks/bench_control_plane.py``),
compiled at the first decode step and torn down with the group; prefill steps, whose length is unbounded,
and side calls stay plain calls. ``RuntimeConfig.compiled_graph`` (the spec's ``runtime``): ``auto`` (GPU
groups; on the CPU the channels' spinning costs more than it saves), ``on``, ``off``. A failure inside the
compiled graph is a lost shard.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from typing import Any

from raysparse.actors.shard_worker import CONCURRENCY_GROUPS, ShardSpec, ShardWorker
from raysparse.step_plan import StepPlan

NODE_ID_LABEL = "ray.io/node-id"
log = logging.getLogger(__name__)


class ShardLostError(RuntimeError):
    """A shard actor of the group (or its draft actor) died; the group must be rebuilt."""


_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-_]|[\x00-\x08\x0b-\x1f\x7f]")


def plain(text: str) -> str:
    """``text`` without terminal escape sequences (Ray colours its errors) or other control characters."""
    return _ESCAPES.sub("", text)


def death_reason(e: BaseException) -> str:
    """Why Ray says an actor died, in one plain line (e.g. "it was killed by `ray.kill`")."""
    lines = [ln.strip() for ln in plain(str(e)).splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("The actor is dead because"):
            return ln[len("The actor is dead because"):].strip().rstrip(".") or ln
    for ln in lines:  # else the first line that is not a task's header ("ray::Class.method() (pid=...)")
        if not ln.startswith("ray::"):
            return ln
    return type(e).__name__


def actor_id(actor: Any) -> str:
    try:
        return actor._actor_id.hex()
    except AttributeError:
        return ""


def choose_node(tp: int, use_gpu: bool, cpus_per_shard: float, load: dict[str, int]) -> str | None:
    """The alive node with room for the whole group and the fewest replicas so far (None: none fits)."""
    import ray

    fits = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = node.get("Resources", {})
        room = res.get("GPU", 0) >= tp if use_gpu else res.get("CPU", 0) >= tp * cpus_per_shard
        if room:
            fits.append((load.get(node["NodeID"], 0), node["NodeID"]))
    return min(fits)[1] if fits else None


class ReplicaGroup:
    def __init__(self, index: int, spec: ShardSpec, tp: int, use_gpu: bool, cpus_per_shard: float = 1.0,
                 node_id: str | None = None, runtime_env: dict[str, Any] | None = None,
                 prefix: str = "raysparse", placement_group: Any = None, first_bundle: int = 0) -> None:
        """``placement_group``: a placement group someone else made and owns (a Ray Serve replica's): the
        shards take its bundles ``first_bundle`` to ``first_bundle + tp - 1`` and ``stop`` leaves it."""
        if tp < 1:
            raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
        self.index, self.spec, self.tp, self.use_gpu = index, spec, tp, use_gpu
        self.cpus_per_shard, self.node_id, self.runtime_env = cpus_per_shard, node_id, runtime_env
        self.generation = 0
        self.prefix = prefix  # names actors and placement groups; unique per engine in a cluster
        self.actors: list[Any] = []
        self.names: list[str] = []
        self.pg: Any = None
        self.external_pg, self.first_bundle = placement_group, first_bundle
        self._dag: Any = None  # the compiled decode step, built on first use
        self._dag_failed = False
        self.step_timeout_s = 600.0
        self.info: list[dict[str, Any]] = []
        # actor id -> what to call the actor when it dies: the shards, and any actor whose results the
        # shards take as arguments (the SpecAttn draft), so a dead draft is not blamed on a shard
        self.actor_names: dict[str, str] = {}

    def start(self, timeout_s: float = 600.0) -> list[dict[str, Any]]:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.generation += 1
        bundle = {"GPU": 1.0, "CPU": self.cpus_per_shard} if self.use_gpu else {"CPU": self.cpus_per_shard}
        selector = [{NODE_ID_LABEL: self.node_id}] * self.tp if self.node_id else None
        if self.external_pg is not None:
            self.pg = self.external_pg
        else:
            self.pg = placement_group([dict(bundle) for _ in range(self.tp)], strategy="PACK",
                                      name=f"{self.prefix}-replica{self.index}-g{self.generation}",
                                      bundle_label_selector=selector)
        if not self.pg.wait(timeout_s):
            self.stop()
            raise TimeoutError(f"replica {self.index}: the cluster has no room for {self.tp} x {bundle} "
                               f"within {timeout_s:.0f} s")
        cls = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(ShardWorker)
        actors = []
        for b in range(self.tp):
            name = f"{self.prefix}-replica{self.index}-shard{b}-g{self.generation}"
            opts: dict[str, Any] = {
                "name": name, "num_cpus": self.cpus_per_shard, "num_gpus": 1 if self.use_gpu else 0,
                # one thread computes (setup, steps, ``__ray_call__`` work); stats and pings run beside it
                # (``CONCURRENCY_GROUPS``)
                "max_restarts": 0, "max_concurrency": 1,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=self.first_bundle + b)}
            env = dict(self.runtime_env or {})
            if self.use_gpu:  # every GPU of the node visible: peers' memory can be mapped (shard_worker)
                env["env_vars"] = {**env.get("env_vars", {}), "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
            if env:
                opts["runtime_env"] = env
            actors.append((b, name, cls.options(**opts).remote(self.spec)))
        infos = ray.get([a.node_info.remote() for _, _, a in actors], timeout=timeout_s)
        order = sorted(range(self.tp), key=lambda i: (infos[i]["node_id"], actors[i][0]))
        self.actors = [actors[i][2] for i in order]
        self.names = [actors[i][1] for i in order]
        self.actor_names.update({actor_id(a): f"shard actor {n}" for a, n in zip(self.actors, self.names, strict=True)})
        master = ray.get(self.actors[0].rendezvous.remote(), timeout=timeout_s)
        setups = [a.setup.remote(r, self.tp, master) for r, a in enumerate(self.actors)]
        self.info = [{**infos[order[r]], **s, "name": self.names[r]}
                     for r, s in enumerate(self._gather(setups, timeout_s))]
        return self.info

    def _gather(self, refs: Sequence[Any], timeout_s: float | None = None) -> list[Any]:
        """Results of one call per shard; raises ShardLostError as soon as any shard is gone."""
        import ray

        pending, done = list(refs), {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                raise TimeoutError(f"replica {self.index}: shards did not answer within {timeout_s} s")
            for ref in ready:
                done[ref] = self.result(refs, ref)
        return [done[r] for r in refs]

    def result(self, refs: Sequence[Any], ref: Any) -> Any:
        """The value of ``ref``, one of ``refs`` (one call per shard, in rank order); raises ShardLostError
        naming the actor when its shard, or an actor whose result the call took, died."""
        import ray

        try:
            return ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
            # The error's actor id is the one that died: the called shard, or the actor that was to
            # produce one of the call's arguments.
            name = self.actor_names.get(getattr(e, "actor_id", None) or "")
            if name is None:
                shard = self.names[list(refs).index(ref)] if self.names else "?"
                name = f"shard actor {shard}"
            raise ShardLostError(f"{name} of replica {self.index} died: {death_reason(e)}") from e

    def check_alive(self, timeout_s: float = 10.0) -> None:
        """Pings every shard; raises ShardLostError naming one that died. A shard too busy to answer within
        ``timeout_s`` is not declared dead here (a step that needs it will find out)."""
        try:
            self._gather([a.ping.remote() for a in self.actors], timeout_s)
        except TimeoutError as e:
            log.debug("replica %d: liveness check: %s", self.index, e)

    def compiled_wanted(self) -> bool:
        mode = self.spec.runtime.compiled_graph  # validated with the engine's config
        return mode == "on" or (mode == "auto" and self.use_gpu)

    def _compiled(self) -> Any:
        if self._dag is None and not self._dag_failed and self.actors and self.compiled_wanted():
            try:
                from ray.dag import InputNode, MultiOutputNode

                with InputNode() as inp:
                    dag = MultiOutputNode([a.execute.bind(inp) for a in self.actors])
                self._dag = dag.experimental_compile()
            except Exception as e:  # noqa: BLE001 - plain calls still work
                log.warning("replica %d: no compiled graph for decode steps (%s: %s)", self.index,
                            type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                self._dag_failed = True
        return self._dag

    def _teardown_compiled(self) -> None:
        dag, self._dag = self._dag, None
        if dag is not None:
            try:
                dag.teardown()
            except Exception:  # noqa: BLE001 - actors already gone
                pass

    def _run_compiled(self, dag: Any, plan: StepPlan) -> list[dict[str, Any]]:
        import ray

        try:
            return list(ray.get(dag.execute(plan), timeout=self.step_timeout_s))
        except Exception as e:  # execute returns its own errors, so anything raised here is the group's
            self._teardown_compiled()
            msg = plain(str(e)).splitlines()[0] if str(e) else ""
            raise ShardLostError(f"shard actor {', '.join(self._dead()) or '?'} of replica {self.index} died "
                                 f"in a compiled step ({type(e).__name__}: {msg})") from e

    def _dead(self) -> list[str]:
        """Names of the shards that no longer answer a ping."""
        import ray

        dead = []
        for name, a in zip(self.names, self.actors, strict=True):
            try:
                ray.get(a.ping.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - dead, or too busy to answer: either way not usable
                dead.append(name)
        return dead

    def execute(self, plan: StepPlan) -> dict[str, Any]:
        dag = None if plan.prefill else self._compiled()
        if dag is not None:
            results = self._run_compiled(dag, plan)
        else:
            results = self._gather([a.execute.remote(plan) for a in self.actors])
        errors = [r["error"] for r in results if r["error"]]
        out = dict(results[0])
        out["error"] = errors[0] if errors else None
        return out

    def stats(self, reset: bool = False) -> list[dict[str, Any]]:
        return self._gather([a.stats.remote(reset) for a in self.actors], 60.0)

    def call(self, method: str, *args: Any, timeout_s: float | None = 120.0) -> list[Any]:
        """``method(*args)`` on every shard, results in rank order (``timeout_s`` None: as long as it takes)."""
        return self._gather(self.submit(method, *args), timeout_s)

    def submit(self, method: str, *args: Any) -> list[Any]:
        """Starts ``method(*args)`` on every shard without waiting; returns the refs in rank order. A caller
        with calls on several groups waits for them all on one thread (``ray.wait``) and takes each value with
        ``result``, instead of blocking a thread per group in ``call``."""
        return [getattr(a, method).remote(*args) for a in self.actors]

    def stop(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        self._teardown_compiled()

        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass  # already gone
        self.actors, self.names = [], []
        if self.pg is not None and self.pg is self.external_pg:
            self.pg = None  # its owner removes it
        self.actor_names = {k: v for k, v in self.actor_names.items() if not v.startswith("shard actor ")}
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None
