"""raysparse.jobs.longcontext: line parsing rules, and a `ray job submit` to a local 2-node cluster end to end."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from raysparse.jobs.records import BadLine, JobDefaults, finished_ids, parse_line

DEFAULTS = JobDefaults("dense", {}, {"max_new_tokens": 7}, chat=True)


def _encode(text: str, chat: bool) -> list[int]:
    return [ord(c) for c in (f"<chat>{text}" if chat else text)]


def test_parse_line_prompt_kinds_and_overrides():
    it = parse_line('{"id": 5, "prompt": "hi", "sampling": {"temperature": 0.5, "seed": 3}}', 1, DEFAULTS, _encode)
    assert it.id == "5" and it.prompt_ids == tuple(_encode("hi", True))
    assert (it.params.max_new_tokens, it.params.temperature, it.params.seed) == (7, 0.5, 3)
    it = parse_line('{"prompt": "hi", "chat": false}', 4, DEFAULTS, _encode)
    assert it.id == "line-4" and it.prompt_ids == tuple(_encode("hi", False))
    it = parse_line('{"prompt_ids": [3, 1, 4], "method": "psaw", "method_params": {"density": 0.1, '
                    '"dense_layers": [0]}}', 2, DEFAULTS, _encode)
    assert it.prompt_ids == (3, 1, 4) and it.method == "psaw"
    assert dict(it.method_params) == {"density": 0.1, "dense_layers": (0,)}
    it = parse_line('{"document": "Doc text.", "question": "Why?"}', 3, DEFAULTS, _encode)
    text = "".join(map(chr, it.prompt_ids))
    assert text.startswith("<chat>") and "Doc text." in text and text.index("Doc text.") < text.index("Why?")
    file_wide = JobDefaults("quest", {"density": 0.2}, {"max_new_tokens": 3}, chat=False)
    it = parse_line('{"prompt_ids": [1]}', 9, file_wide, _encode)
    assert (it.method, dict(it.method_params), it.params.max_new_tokens) == ("quest", {"density": 0.2}, 3)
    it = parse_line('{"prompt_ids": [1], "method": "dense"}', 9, file_wide, _encode)
    assert (it.method, it.method_params) == ("dense", ())  # another method drops the file's method params


@pytest.mark.parametrize("raw", [
    "not json", "[1, 2]", "{}", '{"prompt": ""}', '{"prompt": "  "}', '{"prompt_ids": []}',
    '{"prompt_ids": [1, "a"]}', '{"prompt": "a", "prompt_ids": [1]}', '{"document": "d"}',
    '{"document": "", "question": "q"}', '{"prompt": 5}', '{"prompt": "a", "sampling": {"temperature": -1}}',
    '{"prompt": "a", "sampling": {"top_k": 3}}', '{"prompt": "a", "sampling": {"max_new_tokens": 0}}',
    '{"prompt": "a", "method": ""}', '{"prompt": "a", "method_params": [1]}',
])
def test_bad_lines_are_refused_with_a_reason(raw):
    with pytest.raises(BadLine) as e:
        parse_line(raw, 1, DEFAULTS, _encode)
    assert str(e.value)


def test_finished_ids_ignore_a_torn_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    assert finished_ids(out) == set()
    out.write_text('{"id": "a", "text": "x"}\n{"id": "b", "error": "bad"}\n{"id": "c", "te')
    assert finished_ids(out) == {"a", "b"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_node_cluster():
    """A head (with the dashboard, for the job API) and one more node, each with one CPU."""
    import ray
    from ray.cluster_utils import Cluster

    for k, v in {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
                 "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}.items():
        os.environ.setdefault(k, v)
    if ray.is_initialized():
        ray.shutdown()
    port = _free_port()
    # every node's agent wants port 52365 by default; another Ray instance on the host may hold it, and the
    # head's agent is the one that runs submitted jobs
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": port,
        "dashboard_agent_listen_port": _free_port()})
    try:
        cluster.add_node(num_cpus=1, dashboard_agent_listen_port=_free_port())
        cluster.wait_for_nodes(timeout=120)
        yield f"http://127.0.0.1:{port}"
    finally:
        cluster.shutdown()


def _reference_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_ray_job_submit_processes_a_jsonl_file(two_node_cluster, tmp_path):
    from raysparse.serving.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    g = torch.Generator().manual_seed(time.time_ns() % (1 << 31))
    ids = [torch.randint(2, 100, (int(torch.randint(4, 40, (), generator=g)),), generator=g).tolist()
           for _ in range(4)]
    lines = [{"id": f"ids-{i}", "prompt_ids": p, "sampling": {"max_new_tokens": 6, "ignore_eos": True}}
             for i, p in enumerate(ids)]
    lines += [{"id": "doc", "document": "The gate code is 4721.", "question": "What is the gate code?",
               "method": "psaw", "method_params": {"density": 0.5}, "sampling": {"max_new_tokens": 4}},
              {"id": "bad-sampling", "prompt": "x", "sampling": {"top_p": 0}},
              {"id": "bad-method", "prompt": "x", "method": "no_such_method"},
              {"id": "finished-before", "prompt": "already in the output: skipped, never run"}]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(json.dumps(x) for x in lines[:6]) + "\n{broken json\n"
                   + "\n".join(json.dumps(x) for x in lines[6:]) + "\n")
    out.write_text('{"id": "finished-before", "text": "earlier run"}\n')  # a resumed job skips this id
    ray_cli = Path(sys.executable).parent / "ray"
    deadline = time.monotonic() + 90
    while True:
        sub_id = f"longcontext-{time.time_ns()}"
        cmd = [str(ray_cli), "job", "submit", "--address", two_node_cluster, "--submission-id", sub_id, "--",
               sys.executable, "-m", "raysparse.jobs.longcontext", "--input", str(inp), "--output", str(out),
               "--model", str(model), "--replicas", "2", "--cpus-per-shard", "0.5", "--no-draft",
               "--kv-cache-tokens", "2048", "--max-new-tokens", "5"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            subprocess.run([str(ray_cli), "job", "stop", "--address", two_node_cluster, sub_id], timeout=60)
            raise
        # the head's job agent registers a little after the dashboard answers: the job was not created
        if "No available agent" not in proc.stderr or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"Job '{sub_id}' succeeded" in proc.stdout + proc.stderr
    summary = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"input"')]
    assert summary and (summary[0]["done"], summary[0]["errors"], summary[0]["skipped"]) == (5, 3, 1)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    by_id = {r["id"]: r for r in rows}
    assert len(rows) == len(by_id) == 9  # one line per id, the earlier one kept
    assert by_id["finished-before"] == {"id": "finished-before", "text": "earlier run"}
    for i, p in enumerate(ids):
        r = by_id[f"ids-{i}"]
        assert r["finish_reason"] == "length" and r["prompt_tokens"] == len(p)
        assert r["token_ids"] == _reference_greedy(model, p, 6)
    doc = by_id["doc"]
    assert doc["error"] is None and doc["method"] == "psaw" and 1 <= doc["completion_tokens"] <= 4
    assert doc["prompt_tokens"] > len("The gate code is 4721.What is the gate code?")
    assert "top_p" in by_id["bad-sampling"]["error"] and "no_such_method" in by_id["bad-method"]["error"]
    assert by_id["line-7"]["finish_reason"] == "error" and "not JSON" in by_id["line-7"]["error"]
