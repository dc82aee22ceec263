"""The Ray Serve application (raysparse.serving.app) on a local Ray cluster: two replicas on the CPU, each
owning its shard in its placement group, answering the official `openai` client; shutting Serve down
leaves no actor, placement group or process behind."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

openai = pytest.importorskip("openai")
serve = pytest.importorskip("ray.serve")

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _our_ray_workers() -> list[str]:
    """Titles of the actor processes under this test's raylet (other Ray instances on the host aside; the
    node's own agents and idle pooled workers are not actors)."""
    import psutil
    import ray

    node = ray._private.worker._global_node
    raylet = node.all_processes[ray._private.ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    out = []
    for p in psutil.Process(raylet).children(recursive=True):
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if title.startswith("ray::") and not any(k in title for k in ("IDLE", "DashboardAgent", "RuntimeEnvAgent")):
            out.append(title)
    return out


def _alive_actors() -> list[str]:
    import ray

    table = ray._private.state.state.actor_table(None)
    return sorted(a["ActorClassName"] for a in table.values() if a["State"] != "DEAD")


def _live_placement_groups() -> list[dict]:
    import ray

    return [pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"]


def test_serve_app_two_replicas_answer_the_openai_client(tmp_path):
    import ray

    from raysparse.orchestration.ray_env import WORKER_ENV
    from raysparse.serving.app import build_app
    from raysparse.serving.tiny import CHAT_TEMPLATE, write_tiny_model

    model = write_tiny_model(tmp_path / "tiny", chat_template=CHAT_TEMPLATE)
    if ray.is_initialized():  # an instance an earlier test left behind: this test needs one of its own
        ray.shutdown()
    ray.init(address="local", num_cpus=4, include_dashboard=False, runtime_env={"env_vars": dict(WORKER_ENV)})
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app({"model": str(model), "num_replicas": "2", "cpus_per_shard": "0.5", "replica_cpus": "0.25",
                         "kv_cache_tokens": "1024", "device": "cpu"})
        serve.run(app, name="raysparse", route_prefix="/", blocking=False)
        deadline = time.monotonic() + 120
        while serve.status().applications["raysparse"].status != "RUNNING":
            assert time.monotonic() < deadline, serve.status()
            time.sleep(0.5)
        # each replica's placement group: the replica in bundle 0, its shard in bundle 1
        pgs = _live_placement_groups()
        assert len(pgs) == 2 and all(pg["bundles"] == {0: {"CPU": 0.25}, 1: {"CPU": 0.5}} for pg in pgs), pgs
        assert _alive_actors().count("ShardWorker") == 2

        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        whole = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello there"}],
                                          max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        stream = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello there"}],
                                           max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True})
        text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        assert text == whole.choices[0].message.content and whole.usage.completion_tokens == 8
        sparse = c.completions.create(model="tiny", prompt=list(range(5, 100)) * 3, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True, "raysparse": {
                                          "method": "streaming", "density": 0.25, "sink_tokens": 16,
                                          "block_size": 16, "dense_layers": []}})
        assert sparse.raysparse["method"] == "streaming" and sparse.raysparse["density"]["prefill"] < 0.5
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model="tiny", prompt="hi", max_tokens=-1)
        # Serve spreads the requests over both replicas (each its own engine), with equal greedy outputs
        def one(_: int) -> tuple[str, str]:
            r = c.completions.create(model="tiny", prompt="The same prompt", max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True})
            return r.raysparse["engine"], r.choices[0].text

        engines, texts = set(), set()
        with ThreadPoolExecutor(8) as pool:
            for _ in range(5):
                for engine, out in pool.map(one, range(16)):
                    engines.add(engine)
                    texts.add(out)
                if len(engines) == 2:
                    break
        assert len(engines) == 2 and len(texts) == 1
        c.close()

        serve.shutdown()
        deadline = time.monotonic() + 60
        while _alive_actors() or _live_placement_groups() or _our_ray_workers():
            assert time.monotonic() < deadline, (_alive_actors(), _live_placement_groups(), _our_ray_workers())
            time.sleep(0.5)
    finally:
        serve.shutdown()
        ray.shutdown()


def test_app_config_from_serve_run_arguments_and_the_infra_files():
    from raysparse.serving.app import AppConfig

    cfg = AppConfig.from_args({"model": "/m", "tp": "2", "min_replicas": "1", "max_replicas": "3",
                               "cuda_graphs": "false", "runtime": '{"fused_ops": "torch"}'})
    assert cfg.tp == 2 and cfg.cuda_graphs is False and cfg.runtime == {"fused_ops": "torch"}
    opts = cfg.deployment_options("cuda")
    assert opts["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    assert opts["autoscaling_config"]["max_replicas"] == 3 and "num_replicas" not in opts
    assert cfg.engine_config("cuda").placement == "current"
    for bad in ({"no_such_key": 1}, {"tp": "x"}, {"tp": "0"}, {"min_replicas": "3", "max_replicas": "2"},
                {"cuda_graphs": "maybe"}, {"runtime": '{"no_such_switch": 1}'}, {"dtype": "float8"}):
        with pytest.raises((ValueError, TypeError)):
            AppConfig.from_args(bad)
    serve_cfg = yaml.safe_load((ROOT / "infra" / "serve" / "raysparse-serve.yaml").read_text())
    rayservice = yaml.safe_load((ROOT / "infra" / "kuberay" / "rayservice.yaml").read_text())
    assert rayservice["apiVersion"] == "ray.io/v1" and rayservice["kind"] == "RayService"
    embedded = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    for apps in (serve_cfg["applications"], embedded["applications"]):
        (app,) = apps
        assert app["import_path"] == "raysparse.serving.app:build_app"
        cfg = AppConfig.from_args(app["args"])
        assert cfg.tp == 8 and cfg.max_replicas == 4 and cfg.device == "cuda"
    assert embedded["applications"][0]["args"] == serve_cfg["applications"][0]["args"]
