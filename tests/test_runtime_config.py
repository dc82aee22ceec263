"""The engine's runtime switches: validated where the engine is configured, carried to the shards' parts."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import tiny_model

from raysparse.actors.shard_worker import ShardSpec
from raysparse.kv_cache import KVCache
from raysparse.orchestration.engine_config import EngineConfig
from raysparse.orchestration.replica import ReplicaGroup
from raysparse.runtime_config import RuntimeConfig
from raysparse.shard_executor import ShardExecutor


@pytest.mark.parametrize("field,bad", [("fused_ops", "fast"), ("allreduce", "mpi"), ("compiled_graph", True),
                                       ("fused_allreduce", "off"), ("fused_allreduce", None)])
def test_bad_values_fail_at_construction(field, bad):
    with pytest.raises(ValueError, match=f"runtime.{field}"):
        RuntimeConfig(**{field: bad})


def test_engine_config_carries_a_frozen_runtime():
    rt = RuntimeConfig(fused_ops="torch", allreduce="nccl", fused_allreduce=False, compiled_graph="off")
    assert EngineConfig(runtime=rt).runtime is rt
    assert EngineConfig().runtime == RuntimeConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        rt.fused_ops = "auto"  # type: ignore[misc]
    with pytest.raises(ValueError, match="RuntimeConfig"):
        EngineConfig(runtime={"fused_ops": "torch"})  # type: ignore[arg-type]


@pytest.mark.parametrize("mode,use_gpu,want", [("auto", False, False), ("auto", True, True), ("on", False, True),
                                               ("off", True, False)])
def test_replica_group_reads_compiled_graph_from_the_spec(mode, use_gpu, want):
    spec = ShardSpec(runtime=RuntimeConfig(compiled_graph=mode))
    assert ReplicaGroup(0, spec, 1, use_gpu).compiled_wanted() is want


def test_shard_executor_sets_the_models_fused_ops():
    model = tiny_model("cpu", 2, 2, 2)
    ShardExecutor(model, KVCache(model.cfg, 4, 16), runtime=RuntimeConfig(fused_ops="torch"))
    assert {m.fused_mode for m in (model, model.model.norm, model.model.layers[0].mlp)} == {"torch"}
    ShardExecutor(model, KVCache(model.cfg, 4, 16))
    assert model.model.layers[1].self_attn.fused_mode == "auto"


def test_workers_get_only_the_two_environment_variables(monkeypatch):
    """The kernel override and the weights cache reach the workers; nothing else of the project's."""
    import ray

    from raysparse.orchestration import ray_env

    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    monkeypatch.setenv("RAYSPARSE_KERNELS", "torch")
    monkeypatch.setenv("RAYSPARSE_CACHE", "/tmp/weights")
    monkeypatch.setenv("RAYSPARSE_FUSED_OPS", "torch")  # no longer a switch: not forwarded
    ray_env.start_ray("ray://nowhere:1")
    env = seen["runtime_env"]["env_vars"]
    assert env["RAYSPARSE_KERNELS"] == "torch" and env["RAYSPARSE_CACHE"] == "/tmp/weights"
    assert "RAYSPARSE_FUSED_OPS" not in env
