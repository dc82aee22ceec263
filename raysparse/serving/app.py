"""The Ray Serve application: the OpenAI-compatible API (``openai_api``) in Serve replicas, one engine each.

    serve run raysparse.serving.app:build_app model=/models/llama tp=2 min_replicas=1 max_replicas=4
    serve run infra/serve/raysparse-serve.yaml          # the same from a config file (and in a RayService)

Each Serve replica owns one tensor-parallel group: the deployment's placement group has the replica actor
in bundle 0 and one bundle per shard after it (``{"CPU": cpus_per_shard, "GPU": 1}`` on GPUs, packed on one
node by ``STRICT_PACK``), and the replica's engine starts its shard actors in those bundles
(``EngineConfig.placement = "current"``). Serve routes HTTP requests to the replicas and scales their number
between the config's bounds on ongoing requests per replica, so across nodes Serve replaces raysparse's own
replica router for HTTP traffic; inside a replica the engine batches as it does behind ``raysparse serve``.
A replica reports unhealthy while its engine is not serving (loading, or rebuilding a lost shard), so Serve
routes around it. Shard actors are owned by their replica: ``serve shutdown`` (or a scale-down) ends them.

``build_app(args)`` takes the ``serve run`` arguments (strings) or a config's ``args`` (typed), validated
up front by ``AppConfig``; an unknown key is an error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from ray import serve

from raysparse.orchestration.engine_config import EngineConfig
from raysparse.orchestration.prefix_cache import PrefixCacheConfig
from raysparse.runtime_config import RuntimeConfig


@dataclass(frozen=True)
class AppConfig:
    model: str | None = None  # local HF directory or GGUF file (default: the default model)
    served_model_name: str = ""  # the API's model name ("": the model's directory name)
    tp: int = 1
    dtype: str = "float32"
    device: str = "auto"  # auto: cuda when the cluster has GPUs, else cpu (decided when the app is built)
    kv_cache_tokens: int = 16384  # per replica
    max_batch: int = 64
    decode_steps: int = 1
    cpus_per_shard: float = 1.0
    replica_cpus: float = 1.0  # the Serve replica actor itself (bundle 0)
    cuda_graphs: bool = True
    random_weights: bool = False
    draft: bool = False  # the SpecAttn draft actor (placed outside the bundles)
    draft_model: str | None = None  # SpecAttn's separate draft checkpoint (needs draft; None: self-speculative)
    runtime: dict[str, Any] = field(default_factory=dict)  # RuntimeConfig fields
    prefix_cache: bool = True  # prompts share cached KV pages of equal prefixes
    prefix_cache_tokens: int | None = None  # at most this many tokens of unheld cached pages (None: no limit)
    num_replicas: int | None = None  # fixed count; None: autoscale between the bounds below
    min_replicas: int = 1
    max_replicas: int = 1
    initial_replicas: int | None = None
    target_ongoing_requests: float = 16.0
    max_ongoing_requests: int = 256
    placement_strategy: str = "STRICT_PACK"  # a tensor-parallel group on one node

    def __post_init__(self) -> None:
        if self.min_replicas < 0 or self.max_replicas < max(1, self.min_replicas):
            raise ValueError(f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, got "
                             f"{self.min_replicas}, {self.max_replicas}")
        if self.num_replicas is not None and self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if not self.replica_cpus > 0 or not self.target_ongoing_requests > 0 or self.max_ongoing_requests < 1:
            raise ValueError("replica_cpus > 0, target_ongoing_requests > 0 and max_ongoing_requests >= 1 are required")
        if self.placement_strategy not in ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"):
            raise ValueError(f"placement_strategy must be a Ray placement strategy, got {self.placement_strategy!r}")
        self.engine_config("cpu")  # the engine's own checks, now rather than in every replica

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> AppConfig:
        """``serve run`` gives every value as a string; a config file gives YAML types."""
        args = dict(args or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(args) - set(known))
        if unknown:
            raise ValueError(f"unknown raysparse app argument(s) {unknown}; choose from {sorted(known)}")
        out: dict[str, Any] = {}
        for k, v in args.items():
            default = getattr(cls(), k) if k != "runtime" else {}
            out[k] = _coerce(k, v, default, known[k].type)
        return cls(**out)

    def engine_config(self, device: str) -> EngineConfig:
        return EngineConfig(model=self.model, dtype=self.dtype, tp=self.tp, replicas=1, device=device,
                            kv_cache_tokens=self.kv_cache_tokens, max_batch=self.max_batch,
                            cpus_per_shard=self.cpus_per_shard, draft=self.draft, draft_model=self.draft_model,
                            cuda_graphs=self.cuda_graphs,
                            random_weights=self.random_weights, decode_steps=self.decode_steps,
                            runtime=RuntimeConfig(**self.runtime), placement="current",
                            prefix_cache=PrefixCacheConfig(self.prefix_cache, None if self.prefix_cache_tokens is None
                                                           else self.prefix_cache_tokens // 64))

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import ray

        if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= self.tp:
            return "cuda"
        return "cpu"

    def deployment_options(self, device: str) -> dict[str, Any]:
        shard = {"CPU": self.cpus_per_shard, **({"GPU": 1.0} if device == "cuda" else {})}
        opts: dict[str, Any] = {
            "placement_group_bundles": [{"CPU": self.replica_cpus}] + [dict(shard) for _ in range(self.tp)],
            "placement_group_strategy": self.placement_strategy,
            "ray_actor_options": {"num_cpus": self.replica_cpus},
            "max_ongoing_requests": self.max_ongoing_requests,
            "health_check_period_s": 5.0,
        }
        if self.num_replicas is not None:
            opts["num_replicas"] = self.num_replicas
        else:
            auto = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                    "target_ongoing_requests": self.target_ongoing_requests}
            if self.initial_replicas is not None:
                auto["initial_replicas"] = self.initial_replicas
            opts["autoscaling_config"] = auto
        return opts


def _coerce(name: str, value: Any, default: Any, annotation: Any) -> Any:
    if not isinstance(value, str):
        return value
    ann = str(annotation)
    if name == "runtime":
        import json

        return json.loads(value)
    if value.lower() in ("none", "null") and "None" in ann:
        return None
    if isinstance(default, bool) or ann.startswith("bool"):
        if value.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            raise ValueError(f"{name}={value!r}: expected true or false")
        return value.lower() in ("true", "1", "yes", "on")
    try:
        if isinstance(default, int) or ann.startswith("int"):
            return int(value)
        if isinstance(default, float) or ann.startswith("float"):
            return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a number") from None
    return value


@serve.deployment(name="raysparse")
@serve.ingress()
class RaySparseDeployment:
    """One Serve replica: an engine over the shards in this replica's placement group, and the HTTP API."""

    def __init__(self, engine_cfg: EngineConfig, served_model_name: str = "") -> None:
        from raysparse.orchestration.engine import Engine
        from raysparse.serving.openai_frontend import OpenAIFrontend

        self.engine = Engine(engine_cfg)
        self.engine.start()
        self.frontend = OpenAIFrontend(self.engine, served_model_name)

    def __serve_build_asgi_app__(self) -> Any:
        from raysparse.serving.openai_api import create_app

        return create_app(lambda: self.frontend)

    def check_health(self) -> None:
        if not self.engine.serving():
            raise RuntimeError(f"the engine is {self.engine.state} (replicas: "
                               f"{[r.state for r in self.engine.runners]})")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def build_app(args: dict[str, Any] | None = None) -> Any:
    """The application for ``serve run raysparse.serving.app:build_app KEY=VALUE ...`` and Serve configs."""
    cfg = AppConfig.from_args(args)
    device = cfg.resolved_device()
    return RaySparseDeployment.options(**cfg.deployment_options(device)).bind(
        dataclasses.replace(cfg.engine_config(device)), cfg.served_model_name)
