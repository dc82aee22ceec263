"""raysparse.jobs.longcontext: line parsing rules, hostile input (failing lines, torn output, colliding and
duplicate ids) through the job on an in-process engine and as the real command, and a `ray job submit` to a
local 2-node cluster end to end."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ray_session_in
from serving_helpers import reference_greedy

from raysparse.jobs.records import (
    BadLine,
    JobDefaults,
    assign_ids,
    dumps,
    finished,
    finished_ids,
    parse_line,
    repair_output,
    split_lines,
)

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
    '{"prompt": "a\\ud800"}', '{"document": "d\\udfff", "question": "q"}', '{"prompt_ids": [-1]}',
    '{"prompt": "a", "sampling": {"temperature": NaN}}', '{"prompt": "a", "sampling": {"top_p": 1e999}}',
    '{"prompt": "a", "sampling": {"stop_token_ids": 3}}', "[" * 100_000,
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


def test_split_lines_keeps_unicode_line_separators_and_flags_bytes_that_are_not_utf8():
    data = '{"prompt": "a\u2028b"}\r\n\n  \n'.encode() + b'{"prompt": "\xff"}\n{"id": 1}'
    assert split_lines(data) == [(1, '{"prompt": "a\u2028b"}'), (4, None), (5, '{"id": 1}')]


def test_generated_ids_never_take_a_user_id():
    lines = [(1, '{"prompt": "x"}'), (2, '{"id": "line-1", "prompt": "y"}'), (3, "not json"),
             (4, '{"id": "line-3"}'), (5, '{"id": "line-3~1"}'), (6, "[1]"), (7, "[" * 100_000), (8, None)]
    ids = assign_ids(lines)
    assert ids == {1: "line-1~1", 2: "line-1", 3: "line-3~2", 4: "line-3", 5: "line-3~1", 6: "line-6",
                   7: "line-7", 8: "line-8"}
    assert assign_ids(lines) == ids  # a rerun over the same file gives the same ids


def test_repair_output_cuts_a_torn_tail_and_finished_keys_duplicates_by_line(tmp_path):
    out = tmp_path / "out.jsonl"
    assert repair_output(out) == 0
    whole = b'{"id": "a", "text": "x"}\n{"id": "a", "line": 4, "duplicate_of_line": 1, "error": "dup"}\n'
    torn = b'{"id": "b", "text": "caf\xc3'  # killed mid-character
    out.write_bytes(whole + torn)
    assert repair_output(out) == len(torn) and out.read_bytes() == whole
    assert repair_output(out) == 0 and out.read_bytes() == whole
    done = finished(out)
    assert (done.ids, done.duplicates) == ({"a"}, {("a", 4)})
    out.write_bytes(b'{"id": "c", "te')  # no complete line at all
    assert repair_output(out) == 15 and out.read_bytes() == b""


def test_dumps_escapes_only_what_utf8_cannot_carry():
    assert dumps({"id": "é"}) == '{"id": "é"}\n'.encode()
    line = dumps({"id": "\ud800", "error": "x"})
    assert line == b'{"id": "\\ud800", "error": "x"}\n' and json.loads(line)["id"] == "\ud800"


@pytest.fixture(scope="class")
def job_engine(tmp_path_factory):
    """One in-process engine over the tiny model for the job tests, and the job's parsed flags for it."""
    from raysparse.cli.engine_flags import engine_config
    from raysparse.jobs.longcontext import build_parser
    from raysparse.orchestration.engine import Engine
    from raysparse.serving.tiny import write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("job-tiny"))
    args = build_parser().parse_args(["--input", "-", "--output", "-", "--model", str(model), "--num-cpus", "2",
                                      "--cpus-per-shard", "0.5", "--no-draft", "--kv-cache-tokens", "2048",
                                      "--max-new-tokens", "3", "--ignore-eos", "--timeout", "120"])
    with Engine(engine_config(args)) as engine:
        yield engine, args


class _Hostile:
    """Passes through to the engine, except for failures no real input triggers on demand: a tokenizer that
    raises on "boom", a submit that raises on prompt ids (9, 9, 9), a request that fails on (8, 8, 8)."""

    class _Failing:
        def result(self, timeout: float) -> None:
            raise RuntimeError("the replica died")

        def abort(self) -> None:
            pass

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def encode(self, text: str, chat: bool = True) -> list[int]:
        if "boom" in text:
            raise RuntimeError("tokenizer exploded")
        return self.engine.encode(text, chat=chat)

    def submit(self, req: Any) -> Any:
        if tuple(req.prompt_ids) == (9, 9, 9):
            raise RuntimeError("submit exploded")
        return self._Failing() if tuple(req.prompt_ids) == (8, 8, 8) else self.engine.submit(req)


def _run(job_engine: tuple[Any, argparse.Namespace], inp: Path, out: Path, hostile: bool = False) -> dict[str, int]:
    from raysparse.jobs.longcontext import run_job

    engine, base = job_engine
    args = argparse.Namespace(**{**vars(base), "input": str(inp), "output": str(out)})
    return run_job(args, _Hostile(engine) if hostile else engine)


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in out.read_bytes().decode("utf-8").split("\n") if x]


def _key(row: dict[str, Any]) -> str:
    """An output line's key as one string: the id, or id@line for a duplicate line's error line."""
    return f"{row['id']}@{row['line']}" if "duplicate_of_line" in row else row["id"]


class TestHostileInput:
    def test_a_failing_line_is_its_own_error_and_the_rest_go_on(self, job_engine, tmp_path):
        inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        bad = [b'{"id": "surrogate", "prompt": "x\\ud800y"}', b'{"id": "doc", "document": "d", "question": "\\udc00"}',
               b'{"id": "not-utf8", "prompt": "\xff\xfe"}', b'{"id": "vocab", "prompt_ids": [1, 100000]}',
               b'{"id": "tok", "prompt": "boom"}', b'{"id": "submit", "prompt_ids": [9, 9, 9]}',
               b'{"id": "died", "prompt_ids": [8, 8, 8]}', b"[" * 100_000]
        good = [b'{"id": "first", "prompt": "hello"}', b'{"id": "\\ud800", "prompt_ids": [5, 6]}',
                b'{"id": "last", "prompt": "bye"}']
        inp.write_bytes(b"\n".join([good[0], *bad[:4], good[1], *bad[4:], good[2]]) + b"\n")
        assert _run(job_engine, inp, out, hostile=True) == {"done": 3, "errors": 8, "skipped": 0}
        rows = {r["id"]: r for r in _rows(out)}
        assert len(rows) == 11
        for rid in ("first", "\ud800", "last"):
            assert rows[rid]["error"] is None and rows[rid]["completion_tokens"] == 3
        # the line that is not UTF-8 has no readable id either: it is line-4
        errors = {"surrogate": "not valid Unicode", "doc": "not valid Unicode", "line-4": "not UTF-8",
                  "vocab": "outside the vocabulary", "tok": "tokenizer exploded", "submit": "submit exploded",
                  "died": "the replica died", "line-10": "not JSON"}
        for rid, why in errors.items():
            assert rows[rid]["finish_reason"] == "error" and why in rows[rid]["error"], rows[rid]
        before = out.read_bytes()
        assert _run(job_engine, inp, out, hostile=True) == {"done": 0, "errors": 0, "skipped": 11}
        assert out.read_bytes() == before

    def test_a_torn_tail_is_cut_off_and_its_id_redone(self, job_engine, tmp_path):
        inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        inp.write_text('{"id": "a", "prompt": "one"}\n{"id": "b", "prompt": "two"}\n{"id": "c", "prompt": "3"}\n')
        kept = b'{"id": "a", "text": "earlier run"}\n'
        out.write_bytes(kept + b'{"id": "b", "text": "caf\xc3')  # a killed run tore b's line mid-character
        assert _run(job_engine, inp, out) == {"done": 2, "errors": 0, "skipped": 1}
        assert out.read_bytes().startswith(kept) and out.read_bytes().endswith(b"\n")
        rows = _rows(out)
        assert [r["id"] for r in rows] == ["a", "b", "c"] and rows[1]["completion_tokens"] == 3

    def test_generated_ids_do_not_collide_with_user_ids(self, job_engine, tmp_path):
        inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        inp.write_text('{"prompt": "x"}\n{"id": "line-1", "prompt": "y"}\n{broken\n{"id": "line-3", "prompt": "z"}\n')
        assert _run(job_engine, inp, out) == {"done": 3, "errors": 1, "skipped": 0}
        rows = {r["id"]: r for r in _rows(out)}
        assert set(rows) == {"line-1~1", "line-1", "line-3~1", "line-3"}
        assert all(rows[k]["error"] is None for k in ("line-1~1", "line-1", "line-3"))
        assert "not JSON" in rows["line-3~1"]["error"]
        assert _run(job_engine, inp, out) == {"done": 0, "errors": 0, "skipped": 4}

    def test_duplicate_ids_give_one_result_and_one_error_per_later_line(self, job_engine, tmp_path):
        inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        inp.write_text('{"id": "a", "prompt": "1"}\n{"id": "b", "prompt": "2"}\n{"id": "a", "prompt": "3"}\n'
                       '{"id": "a", "prompt": "4"}\n{"id": "b", "prompt_ids": [1]}\n')
        assert _run(job_engine, inp, out) == {"done": 2, "errors": 3, "skipped": 0}
        rows = _rows(out)
        assert sorted(map(_key, rows)) == ["a", "a@3", "a@4", "b", "b@5"]
        dups = {_key(r): r for r in rows if "duplicate_of_line" in r}
        assert {k: r["duplicate_of_line"] for k, r in dups.items()} == {"a@3": 1, "a@4": 1, "b@5": 2}
        assert all(r["finish_reason"] == "error" and "duplicate id" in r["error"] for r in dups.values())
        # a run killed before a's own result: the restart redoes a and writes no duplicate's line again
        out.write_bytes(b"".join(dumps(r) for r in rows if _key(r) != "a"))
        assert _run(job_engine, inp, out) == {"done": 1, "errors": 0, "skipped": 4}
        assert sorted(map(_key, _rows(out))) == ["a", "a@3", "a@4", "b", "b@5"]


def test_a_job_file_with_a_lone_surrogate_a_torn_tail_and_colliding_ids_completes_with_one_line_per_id(tmp_path):
    """The real command, run twice: every id gets exactly one line (a later duplicate one error line of its
    own, keyed id@line), and the rerun changes nothing."""
    from raysparse.serving.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(b"\n".join([
        b'{"id": "a", "prompt": "alpha"}',
        b'{"id": "lone", "prompt": "bad \\ud800 text"}',  # valid JSON that crashed the tokenizer
        b'{"prompt": "no id, and a user line took line-3"}',
        b'{"id": "line-3", "prompt": "user id"}',
        b'{"id": "a", "prompt": "again"}',
        b'{"id": "torn", "prompt": "its line was torn"}',
        b"{not json",
        b'{"id": "lone", "prompt_ids": [3]}',
    ]) + b"\n")
    out.write_bytes(b'{"id": "a", "text": "earlier run"}\n{"id": "torn", "te')
    cmd = [sys.executable, "-m", "raysparse.jobs.longcontext", "--input", str(inp), "--output", str(out),
           "--model", str(model), "--num-cpus", "2", "--cpus-per-shard", "0.5", "--no-draft",
           "--kv-cache-tokens", "2048", "--max-new-tokens", "3"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a Ray instance of its own
    for counts in ((3, 4, 1), (0, 0, 8)):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        assert (summary["done"], summary["errors"], summary["skipped"]) == counts
        rows = _rows(out)
        keys = [_key(r) for r in rows]
        assert len(keys) == len(set(keys)) == 8
        assert set(keys) == {"a", "lone", "line-3~1", "line-3", "a@5", "torn", "line-7", "lone@8"}
        assert rows[0] == {"id": "a", "text": "earlier run"}
        by_key = {_key(r): r for r in rows}
        assert "not valid Unicode" in by_key["lone"]["error"] and by_key["torn"]["error"] is None
        assert by_key["lone@8"]["duplicate_of_line"] == 2 and "not JSON" in by_key["line-7"]["error"]


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


def test_ray_job_submit_processes_a_jsonl_file(two_node_cluster, tmp_path):
    from raysparse.serving.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    g = torch.Generator().manual_seed(time.time_ns() % (1 << 31))
    ids = [torch.randint(2, 100, (int(torch.randint(4, 40, (), generator=g)),), generator=g).tolist()
           for _ in range(4)]
    lines = [{"id": f"ids-{i}", "prompt_ids": p, "sampling": {"max_new_tokens": 6, "ignore_eos": True}}
             for i, p in enumerate(ids)]
    lines += [{"id": "doc", "document": "The gate code is 4721.", "question": "What is the gate code?",
               "method": "psaw", "method_params": {"dense_layers": [0]}, "sampling": {"max_new_tokens": 4}},
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
        assert r["token_ids"] == reference_greedy(model, p, 6)
    doc = by_id["doc"]
    assert doc["error"] is None and doc["method"] == "psaw" and 1 <= doc["completion_tokens"] <= 4
    assert doc["prompt_tokens"] > len("The gate code is 4721.What is the gate code?")
    assert "top_p" in by_id["bad-sampling"]["error"] and "no_such_method" in by_id["bad-method"]["error"]
    assert by_id["line-7"]["finish_reason"] == "error" and "not JSON" in by_id["line-7"]["error"]


def _own_ray_job(tmp_path: Path, n: int) -> tuple[list[str], Path, dict[str, str]]:
    """The real command over ``n`` requests on the tiny model, starting a Ray instance of its own (no
    RAY_ADDRESS): its command line, its output file and its environment."""
    from raysparse.serving.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": f"q{i}", "prompt_ids": [5, 6, 7, 8] * 8}) + "\n" for i in range(n)))
    cmd = [sys.executable, "-m", "raysparse.jobs.longcontext", "--input", str(inp), "--output", str(out),
           "--model", str(model), "--num-cpus", "2", "--cpus-per-shard", "0.5", "--no-draft",
           "--kv-cache-tokens", "2048", "--max-new-tokens", "40", "--ignore-eos", "--max-inflight", "2"]
    return cmd, out, {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def _watch_job(job: subprocess.Popen, out: Path, lines: int, seen: dict[int, Any]) -> str | None:
    """Polls the running job (up to 240 s) until its Ray session shows among its processes and ``out`` holds
    ``lines`` lines; every process of it seen goes into ``seen`` as it is found, so the caller can check or end
    them even when this fails midway. Returns the session, None if it was never seen."""
    import psutil

    me = psutil.Process(job.pid)
    session = None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and job.poll() is None:
        try:
            seen.update({c.pid: c for c in me.children(recursive=True)})
        except psutil.Error:
            pass
        session = session or ray_session_in(seen.values())
        if session and out.exists() and out.read_bytes().count(b"\n") >= lines:
            break
        time.sleep(0.1)
    return session


@pytest.mark.slow  # about 45 s on 2 cores
def test_a_sigkilled_job_leaves_no_process_of_its_ray_10_s_later(tmp_path):
    """The real command with its own Ray, SIGKILLed mid-file (no handler runs, nothing is cleaned up by the job):
    the instance's reaper ends its daemons, agents and workers; none is left 10 s after the kill."""
    import signal

    import psutil

    from raysparse.orchestration.ray_env import session_processes

    cmd, out, env = _own_ray_job(tmp_path, 2000)
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    seen: dict[int, psutil.Process] = {}
    try:
        session = _watch_job(job, out, 3, seen)  # 3 lines out: serving, so every agent is up
        assert session and job.poll() is None, "the job's Ray daemons were never seen"
        seen.update({p.pid: p for p in session_processes(session)})
        names = " ".join(" ".join(p.cmdline()) for p in seen.values() if p.is_running())
        assert "runtime_env" in names and "raylet" in names, names  # what used to be left is there to end
        job.send_signal(signal.SIGKILL)
        job.wait(30)
        killed = time.monotonic()
        left: list = [None]
        while left and time.monotonic() - killed < 10:
            left = [p for p in seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            left += [p for p in session_processes(session) if p.pid not in seen]
            time.sleep(0.2)
        assert not left, [(p.pid, p.cmdline()) for p in left if p.is_running()]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(30)
        for p in seen.values():  # whatever a failed run left, ended here rather than left behind
            try:
                if p.is_running():
                    p.kill()
            except psutil.Error:
                pass


# SIGTERM (what `ray job stop` sends) in the default run; the other exits, ~30 s each on 2 cores, with `-m slow`
@pytest.mark.parametrize("how", ["SIGTERM", pytest.param("SIGINT", marks=pytest.mark.slow),
                                 pytest.param("end", marks=pytest.mark.slow)])
def test_the_job_stops_the_ray_it_started_on_any_exit(tmp_path, how):
    """The real command with its own Ray: stopped by a signal mid-file, or at its end, no process of that Ray
    instance (daemons, agents, workers) is left, and the output keeps only whole lines."""
    import signal

    import psutil

    from raysparse.orchestration.ray_env import session_processes

    n = 3 if how == "end" else 2000
    cmd, out, env = _own_ray_job(tmp_path, n)
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        seen: dict[int, psutil.Process] = {}
        session = _watch_job(job, out, n if how == "end" else 3, seen)
        assert session, "the job's Ray daemons were never seen"
        seen.update({p.pid: p for p in session_processes(session)})  # the agents and workers, by their session
        assert len(seen) >= 4, [p.info for p in seen.values()]
        if how != "end":
            job.send_signal(getattr(signal, how))
        stdout, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(30)
    assert job.returncode == (0 if how == "end" else 128 + getattr(signal, how)), stderr[-3000:]
    left = [p for p in seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    left += [p for p in session_processes(session) if p.pid not in seen]
    assert not left, [(p.pid, p.cmdline()) for p in left if p.is_running()]
    rows = _rows(out)  # only whole lines: a line cut by the signal would not parse
    assert rows and len({r["id"] for r in rows}) == len(rows)
    if how == "end":
        assert len(rows) == n and json.loads(stdout.strip().splitlines()[-1])["done"] == n
    else:
        assert f"signal {getattr(signal, how)}" in stderr
