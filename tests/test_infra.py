"""infra/: every manifest parses, has the shape its tool expects, and names only commands that exist here
(modules importable, console scripts defined, raysparse subcommands whose arguments parse)."""

from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
SHELL_BUILTINS = {"ulimit", "cd", "export", "echo", "nohup", "sleep", "true", "set"}
SYSTEM_TOOLS = {"ray", "serve", "python", "python3", "pip", "kubectl", "docker", "curl", "wget", "grep", "/bin/bash",
                "bash"}


def _strings(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for v in node.values() for s in _strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in _strings(v)]
    return []


def _commands(text: str) -> list[list[str]]:
    """Simple commands of a shell line: split on ; && || & | and newlines, redirections dropped."""
    out = []
    text = re.sub(r"\d*>&\d+|\d*>>?\s*\S+", " ", text.replace("\\\n", " "))
    for part in re.split(r"\s*(?:;|&&|\|\||&|\||\n)\s*", text):
        try:
            words = shlex.split(part)
        except ValueError:
            continue
        while words and words[0] in ("nohup",):
            words = words[1:]
        if words:
            out.append(words)
    return out


def _console_scripts() -> set[str]:
    """Names in pyproject's [project.scripts] whose ``module:function`` target exists."""
    section = (ROOT / "pyproject.toml").read_text().split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    names = set()
    for name, target in re.findall(r'^([\w-]+)\s*=\s*"([\w.]+:\w+)"', section, re.M):
        mod, func = target.split(":")
        if callable(getattr(importlib.import_module(mod), func, None)):
            names.add(name)
    return names


def check_command(words: list[str]) -> str | None:
    """None when the command exists here and its arguments parse; else why not."""
    from raysparse.cli import build_parser

    head = words[0]
    if head in ("python", "python3") and len(words) > 2 and words[1] == "-m":
        mod = words[2]
        if importlib.util.find_spec(mod) is None:
            return f"module {mod} is not importable"
        if mod.startswith("raysparse."):
            parser = getattr(importlib.import_module(mod), "build_parser", None)
            if parser is None:
                return f"{mod} has no build_parser to check its arguments with"
            try:
                parser().parse_args(words[3:])
            except SystemExit:
                return f"{mod} rejects {words[3:]}"
        return None
    if head in ("python", "python3") and len(words) > 2 and words[1] == "-c":
        for mod in re.findall(r"import ([\w.]+(?:,\s*[\w.]+)*)", words[2]):
            for m in mod.split(","):
                if importlib.util.find_spec(m.strip()) is None:
                    return f"module {m.strip()} is not importable"
        return None
    if head == "raysparse":
        if head not in _console_scripts():
            return "the raysparse console script is not defined"
        try:
            build_parser().parse_args(words[1:])
        except SystemExit:
            return f"raysparse rejects {words[1:]}"
        return None
    if head == "ray" and words[1:3] == ["job", "submit"] and "--" in words:
        return check_command(words[words.index("--") + 1:])
    if head in SYSTEM_TOOLS or head in SHELL_BUILTINS:
        return None
    return f"unknown command {head!r}"


def _yaml(path: Path) -> dict[str, Any]:
    docs = list(yaml.safe_load_all(path.read_text()))
    assert len(docs) == 1 and isinstance(docs[0], dict), path
    return docs[0]


def test_cluster_launcher_config():
    cfg = _yaml(INFRA / "ray-cluster.yaml")
    for key in ("cluster_name", "provider", "available_node_types", "head_node_type", "head_start_ray_commands",
                "worker_start_ray_commands"):
        assert key in cfg, key
    assert cfg["head_node_type"] in cfg["available_node_types"]
    assert any(t["resources"].get("GPU", 0) > 0 for t in cfg["available_node_types"].values())
    lines = [c for k in ("setup_commands", "head_start_ray_commands", "worker_start_ray_commands") for c in cfg[k]]
    cmds = [w for line in lines for w in _commands(line)]
    assert any(w[:2] == ["raysparse", "serve"] for w in cmds)
    for words in cmds:
        assert check_command(words) is None, (words, check_command(words))


def _pod_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    groups = [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def test_kuberay_raycluster():
    doc = _yaml(INFRA / "kuberay" / "raycluster.yaml")
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayCluster"
    spec = doc["spec"]
    assert any(int(c["resources"]["limits"].get("nvidia.com/gpu", 0)) > 0 for c in _pod_containers(spec))
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {"containerPort": 50051, "name": "grpc"} in head["ports"]
    assert head["readinessProbe"]["grpc"]["port"] == 50051  # the gRPC health service
    command = head["lifecycle"]["postStart"]["exec"]["command"]
    assert command[:2] == ["/bin/bash", "-c"] and len(command) == 3
    cmds = _commands(command[2])
    assert any(w[:2] == ["raysparse", "serve"] for w in cmds)
    for words in cmds:
        assert check_command(words) is None, (words, check_command(words))


def test_kuberay_rayjob():
    doc = _yaml(INFRA / "kuberay" / "rayjob.yaml")
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayJob"
    words = shlex.split(doc["spec"]["entrypoint"])
    assert words[:3] == ["python", "-m", "raysparse.jobs.longcontext"]
    assert check_command(words) is None, check_command(words)
    containers = _pod_containers(doc["spec"]["rayClusterSpec"])
    assert any(int(c["resources"]["limits"].get("nvidia.com/gpu", 0)) > 0 for c in containers)


def test_dockerfile_copies_what_exists_and_runs_a_defined_command():
    text = (INFRA / "Dockerfile").read_text()
    for src in re.findall(r"^COPY\s+(.+?)\s+\S+$", text, re.M):
        for path in src.split():
            assert (ROOT / path).exists(), f"COPY {path}: not in the repository"
    cmd = re.search(r"^CMD\s+(\[.*\])$", text, re.M)
    assert cmd is not None
    words = yaml.safe_load(cmd.group(1))
    assert check_command(words) is None, check_command(words)
    assert "pip install" in text and "torch==2.13.0" in text


def test_infra_readme_commands_exist():
    text = (INFRA / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", text, re.S)
    cmds = [w for b in blocks for w in _commands(b.replace("<head-ip>", "10.0.0.1"))]
    assert any(w[:2] == ["ray", "start"] for w in cmds)
    for words in cmds:
        assert check_command(words) is None, (words, check_command(words))


@pytest.mark.parametrize("words,ok", [
    (["python", "-m", "raysparse.jobs.longcontext", "--input", "a", "--output", "b"], True),
    (["python", "-m", "raysparse.jobs.longcontext", "--output", "b"], False),  # --input is required
    (["python", "-m", "raysparse.no_such_module"], False),
    (["raysparse", "serve", "--tp", "2"], True),
    (["raysparse", "serve", "--no-such-flag"], False),
    (["raysparse", "no-such-command"], False),
    (["definitely-not-a-command", "x"], False),
])
def test_the_checker_can_fail(words, ok):
    assert (check_command(words) is None) == ok


def test_grafana_dashboard_queries_metrics_the_server_exports():
    """Every raysparse: series a panel queries is one the engine metrics export (vLLM's names)."""
    import json

    from raysparse.serving.engine_metrics import EngineMetrics

    class _Engine:
        state, source_name = "created", "m"

        def add_request_observer(self, fn: Any) -> None:
            pass

    exported = set()
    for fam in EngineMetrics(_Engine()).registry.collect():
        suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}.get(fam.type, ("",))
        exported |= {fam.name + s for s in suffixes}
    dash = json.loads((INFRA / "grafana" / "raysparse-dashboard.json").read_text())
    queried = {name for p in dash["panels"] for t in p["targets"]
               for name in re.findall(r"raysparse:[a-z0-9_]+", t["expr"])}
    assert queried and queried <= exported, queried - exported
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "request_success_total", "attention_density_bucket",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket"):
        assert f"raysparse:{name}" in queried, name
    assert {p["id"] for p in dash["panels"]} == set(range(1, len(dash["panels"]) + 1))
