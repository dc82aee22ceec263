"""Stalls and faults against real `raysparse serve` processes: health and server info under 300 open streams,
health while draining, a 7000-token prefill beside a running stream (the default model, on the CPU), and a
killed draft actor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from helpers import free_port

from raysparse.serving.client import RaySparseClient, build_request

CLI = [sys.executable, "-m", "raysparse.cli"]


class Served:
    """`raysparse serve` in its own process (its own local Ray), stopped with SIGTERM at the end.

    The server starts its Ray before it binds gRPC (Ray forks its daemons first), so one of Ray's own random
    ports can take the free port picked here in between: such a start (the server exits, the port in use) is
    retried on another port. A server that exits fails the wait at once instead of at its timeout."""

    def __init__(self, *args: str, timeout: float = 180.0, attempts: int = 3) -> None:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        for attempt in range(attempts):
            self.port = free_port()
            self.proc = subprocess.Popen([*CLI, "serve", "--port", str(self.port), "--no-metrics", "--num-cpus",
                                          "2", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         env=env)
            self.target = f"127.0.0.1:{self.port}"
            self.client = RaySparseClient(self.target)
            try:
                self._wait(timeout)
                return
            except BaseException:
                out = self.close()
                if "Failed to bind" in out and attempt + 1 < attempts:
                    continue  # the port was taken meanwhile: another one
                print(f"server output (last 4000 characters):\n{out[-4000:]}")  # shown with the failure
                raise

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"raysparse serve exited with {self.proc.returncode} before it was SERVING")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.target} was not SERVING within {timeout:.0f} s")
            try:
                self.client.wait_serving(min(2.0, left), poll_s=0.2)
                return
            except TimeoutError:
                continue

    def close(self) -> str:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return self.proc.stdout.read() if self.proc.stdout else ""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from raysparse.serving.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny"), max_positions=1024)


def test_health_and_server_info_answer_within_1_s_with_300_streams_open(tiny_model):
    """Every stream holds one of the server's 256 threads while it waits for tokens (the last 44 wait for a
    thread); health checks and GetServerInfo run on threads of their own, so they answer at once."""
    srv = Served("--model", str(tiny_model), "--cpus-per-shard", "0.5", "--no-draft", "--kv-cache-tokens", "1024",
                 "--grace", "0")
    calls = []
    try:
        # Each stream may take 900 tokens and the cache holds one at a time: they all stay open for minutes.
        for i in range(300):
            calls.append(srv.client.stub.Generate(build_request(token_ids=[5, 6, 7, i % 50 + 2], max_new_tokens=900,
                                                                ignore_eos=True), timeout=300))
        deadline = time.monotonic() + 60
        with RaySparseClient(srv.target) as probe:
            while True:  # every thread of the server's pool is taken by a stream
                info = probe.server_info(timeout=5)
                if info.running + info.waiting >= 250:
                    break
                assert time.monotonic() < deadline, info
                time.sleep(0.2)
            worst = 0.0
            for _ in range(10):
                t0 = time.monotonic()
                assert probe.health(timeout=1.0) == "SERVING"
                t1 = time.monotonic()
                info = probe.server_info(timeout=1.0)
                t2 = time.monotonic()
                worst = max(worst, t1 - t0, t2 - t1)
                assert info.serving and info.running + info.waiting >= 250
                time.sleep(0.1)
            assert worst < 1.0
            assert sum(c.running() for c in calls) == 300  # none ended meanwhile
    finally:
        for c in calls:
            c.cancel()
        srv.close()


def test_draining_answers_not_serving_for_the_grace_period(tiny_model):
    """SIGTERM: for --grace seconds health answers NOT_SERVING (it is not refused), new calls are UNAVAILABLE
    and a stream in flight runs to its end; then the server exits 0."""
    grace = 3.0
    srv = Served("--model", str(tiny_model), "--cpus-per-shard", "0.5", "--no-draft", "--kv-cache-tokens", "1024",
                 "--grace", str(grace))
    try:
        stream = srv.client.stub.Generate(build_request(token_ids=[5, 6, 7], max_new_tokens=300, ignore_eos=True),
                                          timeout=120)
        first = next(stream)
        assert first.delta.token_ids
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        answers: list[tuple[float, str]] = []
        refused = None
        with RaySparseClient(srv.target) as probe:
            while srv.proc.poll() is None and time.monotonic() - t0 < grace + 30:
                try:
                    answers.append((time.monotonic() - t0, probe.health(timeout=1.0)))
                except grpc.RpcError as e:
                    answers.append((time.monotonic() - t0, e.code().name))
                if refused is None and answers[-1][1] == "NOT_SERVING":
                    with pytest.raises(grpc.RpcError) as e:
                        probe.generate(token_ids=[4, 5], max_new_tokens=2, timeout=10)
                    refused = e.value.code()
                time.sleep(0.05)
        rest = list(stream)
        assert srv.proc.wait(timeout=60) == 0
    finally:
        log = srv.close()
    assert refused == grpc.StatusCode.UNAVAILABLE
    served_after = [s for t, s in answers if t > 0.5]
    assert "SERVING" not in served_after, answers
    not_serving = [t for t, s in answers if s == "NOT_SERVING"]
    assert not_serving and not_serving[-1] - not_serving[0] >= grace - 1.0, answers  # answered, all along
    assert all(s == "NOT_SERVING" for t, s in answers if 0.5 < t < grace - 0.5), answers
    assert rest and rest[-1].finish.finish_reason == "length"  # the stream in flight went on to its end
    assert sum(len(r.delta.token_ids) for r in rest) + len(first.delta.token_ids) == 300
    assert "draining" in log


@pytest.mark.slow  # ~60 s on 2 cores (a draft actor killed twice, a replica rebuilt): `pytest -m slow`
def test_a_killed_draft_actor_is_named_not_blamed_on_a_shard(tiny_model):
    """The engine's liveness check finds a draft actor killed while idle; the replica is rebuilt, and the error
    names the draft in plain text. A draft killed during a SpecAttn stream fails it with the same naming."""
    import ray

    from raysparse.orchestration.engine import Engine, EngineConfig
    from raysparse.orchestration.engine_api import EngineRequest
    from raysparse.sampling import SamplingParams

    eng = Engine(EngineConfig(model=str(tiny_model), num_cpus=2, cpus_per_shard=0.5, kv_cache_tokens=1024,
                              page_size=16, draft=True, load_timeout_s=120)).start()
    try:
        runner = eng.runners[0]

        def rebuilt(n: int) -> dict:
            deadline = time.monotonic() + 120
            while True:
                info = eng.server_info()["replicas"][0]
                if info["rebuilds"] >= n and info["state"] == "ready":
                    return info
                assert time.monotonic() < deadline, info
                time.sleep(0.05)

        draft = runner.spec_step.name
        t0 = time.monotonic()
        ray.kill(ray.get_actor(draft))
        while eng.serving():
            assert time.monotonic() - t0 < 5, "the dead draft was not found while idle"
            time.sleep(0.02)
        info = rebuilt(1)
        assert info["last_error"].startswith(f"draft actor {draft} of replica 0 died")
        assert "shard" not in info["last_error"] and "\x1b" not in info["last_error"]

        # during a SpecAttn stream: the shards wait for the dead draft's message
        draft = runner.spec_step.name
        h = eng.submit(EngineRequest(tuple(range(20, 60)), SamplingParams(max_new_tokens=600, ignore_eos=True),
                                     "specattn", (("top_p", 0.9),)))
        h.get(60)  # a token is out
        ray.kill(ray.get_actor(draft))
        fin = h.result(60)
        assert fin.finish_reason == "error" and f"draft actor {draft} of replica 0 died" in fin.error, fin.error
        assert "shard" not in fin.error and "\x1b" not in fin.error
        rebuilt(2)
        ok = eng.submit(EngineRequest((4, 5, 6), SamplingParams(max_new_tokens=3, ignore_eos=True))).result(60)
        assert ok.finish_reason == "length"
    finally:
        eng.shutdown()


@pytest.mark.slow  # ~90 s of the real model on 2 cores, and timing-bound: run alone (`pytest -m slow`)
def test_a_7000_token_prefill_leaves_other_streams_no_gap_over_2_s():
    """The default model on the CPU (the default prefill chunk): while a 7000-token prompt prefills, a running
    stream's largest gap between two tokens is at most 2 s; a second long prompt whose deadline passes during
    its prefill stops at its next chunk and frees its KV."""
    from raysparse.loader import ModelNotFoundError, default_model_path

    try:
        default_model_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    srv = Served("--no-draft", "--grace", "0", timeout=300)
    try:
        stamps: list[float] = []
        stream = srv.client.stub.Generate(build_request(token_ids=[1, 2, 3, 4], max_new_tokens=4000,
                                                        ignore_eos=True), timeout=600)

        def read() -> None:
            try:
                for msg in stream:
                    stamps.extend([time.monotonic()] * len(msg.delta.token_ids))
            except grpc.RpcError:
                pass  # cancelled at the end

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        fin = srv.client.generate(token_ids=list(range(100, 7100)), max_new_tokens=2, ignore_eos=True, timeout=300)
        t1 = time.monotonic()
        assert fin.finish_reason == "length" and fin.prompt_tokens == 7000
        during = [t for t in stamps if t0 - 5 <= t <= t1]
        gaps = [b - a for a, b in zip(during, during[1:], strict=False)]
        print(f"7000-token prefill: {t1 - t0:.1f} s, {len(during)} tokens of the other stream, largest gap "
              f"{max(gaps):.2f} s")
        assert len(during) > 10 and max(gaps) <= 2.0, (max(gaps), t1 - t0)
        # The deadline passes part-way through the prompt: the request stops at the next chunk.
        with pytest.raises(grpc.RpcError) as e:
            srv.client.generate(token_ids=list(range(100, 7100)), max_new_tokens=2, timeout=3.0)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        t_dead = time.monotonic()
        while True:
            info = srv.client.server_info()
            if info.running == 1 and info.waiting == 0 and info.kv_used_tokens <= 4100:
                break  # only the running stream holds KV again
            assert time.monotonic() - t_dead < 3.0, info
            time.sleep(0.05)
        stream.cancel()
        reader.join(timeout=30)
    finally:
        srv.close()
