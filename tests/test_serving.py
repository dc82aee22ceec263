"""The gRPC server against a real engine on 127.0.0.1 (a tiny random Llama with a character tokenizer, CPU)."""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest
import torch
from helpers import free_port
from serving_helpers import reference_greedy, wait_kv_free

from raysparse.serving.client import RaySparseClient

KV_TOKENS = 768  # below the model's 1024 positions, so a request can fit the context but not the cache
MAX_POS = 1024


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from raysparse.orchestration.engine import Engine, EngineConfig
    from raysparse.serving.server import InferenceServer, ServerConfig
    from raysparse.serving.tiny import write_tiny_model

    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny"), max_positions=MAX_POS)
    eng = Engine(EngineConfig(model=str(model_dir), num_cpus=2, cpus_per_shard=0.5, kv_cache_tokens=KV_TOKENS,
                              page_size=16, draft=False, load_timeout_s=120))
    srv = InferenceServer(eng, ServerConfig(port=0, metrics_port=0, poll_s=0.05, density_poll_s=0.3,
                                            grace_s=0.2)).start()
    client = RaySparseClient(f"127.0.0.1:{srv.port}")
    try:
        assert client.health() == "NOT_SERVING"  # the port answers before the engine has loaded
        srv.start_engine()
        client.wait_serving(60)
        yield srv, client, model_dir
    finally:
        client.close()
        srv.stop()


def test_streaming_generate_matches_reference(served):
    srv, client, model_dir = served
    g = torch.Generator().manual_seed(int(time.time()))
    text = "".join(chr(c) for c in torch.randint(ord("a"), ord("z") + 1, (int(torch.randint(5, 40, ())),),
                                                 generator=g).tolist())
    n = 12
    chunks = list(client.stream(text=text, max_new_tokens=n, ignore_eos=True))
    deltas, fin = chunks[:-1], chunks[-1].finish
    assert fin is not None and all(c.finish is None for c in deltas) and len(deltas) >= 2  # it streamed
    ids = [t for c in deltas for t in c.token_ids]
    prompt = [ord(ch) - ord("a") + 12 for ch in text]  # the tiny tokenizer: 'a' is id 12, in order
    assert fin.usage.prompt_tokens == len(prompt)
    assert ids == reference_greedy(model_dir, prompt, n)
    assert fin.finish_reason == "length" and fin.usage.completion_tokens == n
    assert "".join(c.text for c in deltas) == fin.text
    assert fin.timings.ttft_s > 0 and fin.timings.e2e_s >= fin.timings.ttft_s
    assert len({c.request_id for c in chunks}) == 1


def test_bad_inputs_get_their_status_codes(served):
    _, client, _ = served
    bad = [
        (dict(token_ids=[]), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(text=""), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(text=" \t\n  "), grpc.StatusCode.INVALID_ARGUMENT),  # empty once stripped
        (dict(token_ids=[3] * (MAX_POS - 10), max_new_tokens=20), grpc.StatusCode.INVALID_ARGUMENT),  # context
        (dict(token_ids=[3], temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(token_ids=[3], temperature=float("nan")), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(token_ids=[3], top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(token_ids=[3], top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT),
        # would underflow in the sampler (they used to pass here and fail during generation)
        (dict(token_ids=[3], temperature=1e-300), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(token_ids=[3], temperature=1.0, top_p=1e-300), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(token_ids=[3], method="no_such_method"), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(token_ids=[3], method="psaw", method_params={"bogus": 1}), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(token_ids=[3], method="psaw", method_params={"density": 2.0}), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(token_ids=[3], method_params={"density": 0.2}), grpc.StatusCode.INVALID_ARGUMENT),  # dense has none
        (dict(token_ids=[10_000]), grpc.StatusCode.INVALID_ARGUMENT),  # outside the vocabulary
        # a parameter's value must have its config field's type: a bool is not a number (it used to be served
        # as 1.0), null is not a value (it used to fail in the shard with a Python message), nor a string or list
        *[(dict(token_ids=[3], method="quest", method_params={"density": v}), grpc.StatusCode.INVALID_ARGUMENT)
          for v in (True, None, "0.1", [0.1])],
        (dict(token_ids=[3], method="streaming", method_params={"sink_tokens": False}),
         grpc.StatusCode.INVALID_ARGUMENT),
        (dict(token_ids=[3], method="quest", method_params={"dense_layers": [0, True]}),
         grpc.StatusCode.INVALID_ARGUMENT),
        (dict(token_ids=[3] * (KV_TOKENS - 8), max_new_tokens=40), grpc.StatusCode.RESOURCE_EXHAUSTED),
    ]
    for kwargs, code in bad:
        with pytest.raises(grpc.RpcError) as e:
            client.generate(max_new_tokens=kwargs.pop("max_new_tokens", 4), timeout=30, **kwargs)
        assert e.value.code() == code, (kwargs, e.value.details())
        assert e.value.details() and "\n" not in e.value.details()
        assert "Error" not in e.value.details(), e.value.details()  # the project's words, no Python exception
        ok = client.generate(token_ids=[5, 6, 7], max_new_tokens=3, ignore_eos=True, timeout=30)
        assert ok.finish_reason == "length" and len(ok.token_ids) == 3  # still serving
    assert client.health() == "SERVING"
    wait_kv_free(client)


def test_every_numeric_method_parameter_refuses_bools_nulls_strings_and_lists(served):
    """At the engine's request check, which every front end submits through: each method's every number field."""
    import dataclasses
    import typing

    from raysparse.methods.registry import get_method, method_names
    from raysparse.orchestration.engine_api import EngineRequest, InvalidRequestError

    eng = served[0].engine
    checked = 0
    for name in method_names():
        spec = get_method(name)
        if spec.config_cls is None:
            continue
        hints = typing.get_type_hints(spec.config_cls)
        for f in dataclasses.fields(spec.config_cls):
            kind = hints[f.name]
            numeric = kind in (int, float) or set(typing.get_args(kind)) in ({int, type(None)}, {float, type(None)})
            if f.name not in spec.params or not numeric:
                continue
            for value in (True, False, None, "1", [1]):
                with pytest.raises(InvalidRequestError) as e:
                    eng.validate(EngineRequest((3, 4), method=name, method_params={f.name: value}))
                msg = str(e.value)
                assert f.name in msg and name in msg and "\n" not in msg and "Error" not in msg, msg
                checked += 1
    assert checked > 100  # every method's numeric fields, five values each


def test_prompt_bytes_are_checked_before_tokenizing_and_tokenizing_runs_on_its_own_thread(served, monkeypatch):
    srv, client, _ = served
    eng = srv.engine
    limit = eng.max_prompt_bytes
    assert limit == MAX_POS * len("<unk>")  # the positions times the tiny vocabulary's longest entry
    calls: list[str] = []
    encode = eng._encode

    def recording(text: str, chat: bool) -> list[int]:
        calls.append(threading.current_thread().name)
        return encode(text, chat)

    monkeypatch.setattr(eng, "_encode", recording)
    for size in (limit + 1, 4_000_000):
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            client.generate(text="a" * size, max_new_tokens=2, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"{size} bytes" in e.value.details()
        assert time.monotonic() - t0 < 2
    assert calls == []  # refused before the tokenizer saw it
    ok = client.generate(text="hello", max_new_tokens=2, ignore_eos=True, timeout=30)
    assert ok.finish_reason == "length" and calls == ["raysparse-tokenizer_0"]  # not the call's own thread
    with pytest.raises(grpc.RpcError) as e:  # at the limit it is tokenized, and the context check refuses it
        client.generate(text="a" * limit, max_new_tokens=2, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "positions" in e.value.details()
    assert len(calls) == 2


def test_one_request_id_is_in_flight_at_most_once(served):
    """Two clients with one request id: the second is refused and neither disturbs the other's request."""
    srv, client, _ = served
    wait_kv_free(client)
    rid = f"shared-{time.time_ns()}"
    n = 60
    with RaySparseClient(f"127.0.0.1:{srv.port}") as other:
        stream = client.stream(request_id=rid, token_ids=[7, 8, 9], max_new_tokens=n, ignore_eos=True, timeout=120)
        chunks = [next(stream)]
        for call in (lambda: other.generate(request_id=rid, token_ids=[4, 5], max_new_tokens=3, timeout=30),
                     lambda: list(other.stream(request_id=rid, token_ids=[4, 5], max_new_tokens=3, timeout=30))):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS, e.value.details()
            assert rid in e.value.details()
        chunks += list(stream)  # the refused duplicates ended nothing: the first request runs to its length
        fin = chunks[-1].finish
        assert fin.finish_reason == "length" and fin.usage.completion_tokens == n
        assert sum(len(c.token_ids) for c in chunks[:-1]) == n and {c.request_id for c in chunks} == {rid}
        # A finished request frees its id, and the end of its call aborts nothing that reuses the id.
        for _ in range(3):
            done = other.generate(request_id=rid, token_ids=[4, 5], max_new_tokens=2, ignore_eos=True, timeout=30)
            assert done.finish_reason == "length"
            again = client.generate(request_id=rid, token_ids=[7, 8, 9], max_new_tokens=8, ignore_eos=True,
                                    timeout=60)
            assert again.finish_reason == "length" and len(again.token_ids) == 8
        # Abort by id reaches the one request that holds it.
        out: dict = {}
        th = threading.Thread(target=lambda: out.setdefault("c", client.generate(
            request_id=rid, token_ids=[7, 8, 9], max_new_tokens=KV_TOKENS - 16, ignore_eos=True, timeout=120)))
        th.start()
        deadline = time.monotonic() + 30
        while client.server_info().running == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert other.abort(rid)
        th.join(timeout=30)
        assert out["c"].finish_reason == "abort"
    wait_kv_free(client)


def test_unknown_method_names_add_no_metric_series(served):
    srv, client, _ = served

    def series() -> set[str]:
        body = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
        return {line.rsplit(" ", 1)[0] for line in body.splitlines()
                if line.startswith("raysparse_") and 'method="' in line}

    def unknown(i: int) -> None:
        with pytest.raises(grpc.RpcError) as e:
            client.generate(token_ids=[3], method=f"no_such_method_{i}_{time.time_ns()}", max_new_tokens=2, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    unknown(-1)  # the first one may open the ("invalid", "invalid_argument") series
    name = 'raysparse_requests_total{method="invalid",outcome="invalid_argument"}'
    before, count = series(), _metric(srv, name)
    for i in range(40):
        unknown(i)
    assert series() == before
    assert _metric(srv, name) == count + 40


def test_undecodable_requests_are_invalid_argument(served):
    """Bytes that are no valid message (e.g. a string field that is not UTF-8) are the client's error."""
    _, client, _ = served
    raw = {m: client.channel.unary_unary(f"/raysparse.v1.RaySparse/{m}", request_serializer=None,
                                         response_deserializer=None) for m in ("Abort", "GetServerInfo")}
    generate = client.channel.unary_stream("/raysparse.v1.RaySparse/Generate", request_serializer=None,
                                           response_deserializer=None)
    not_utf8 = b"\x0a\x02\xff\xfe"  # field 1 (Generate: text, Abort: request_id), length 2, invalid UTF-8
    truncated = b"\x0a\x10ab"  # announces 16 bytes, holds 2
    for payload in (not_utf8, truncated):
        for call in (lambda p=payload: list(generate(p, timeout=30)), lambda p=payload: raw["Abort"](p, timeout=30)):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert "decoded" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        raw["GetServerInfo"](b"\xff\xff", timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ok = client.generate(token_ids=[5, 6, 7], max_new_tokens=3, ignore_eos=True, timeout=30)
    assert ok.finish_reason == "length"  # still serving


def test_unavailable_while_the_engine_is_not_ready():
    from raysparse.orchestration.engine import Engine, EngineConfig
    from raysparse.serving.server import InferenceServer, ServerConfig

    eng = Engine(EngineConfig())
    eng.state = "loading"  # as while a replica loads its weights (nothing is started here)
    srv = InferenceServer(eng, ServerConfig(port=0, metrics_port=None, grace_s=0.0)).start()
    try:
        with RaySparseClient(f"127.0.0.1:{srv.port}") as c:
            assert c.health() == "NOT_SERVING"
            assert c.health("raysparse.v1.RaySparse") == "NOT_SERVING"
            for call in (lambda: c.generate(token_ids=[1, 2]), c.model_info):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop(shutdown_engine=False)


def test_32_concurrent_streams_match_sequential_greedy(served):
    _, client, _ = served
    g = torch.Generator().manual_seed(int(time.time()) + 1)
    prompts = [torch.randint(2, 100, (int(torch.randint(3, 48, (), generator=g)),), generator=g).tolist()
               for _ in range(32)]
    n = 10
    sequential = [client.generate(token_ids=p, max_new_tokens=n, ignore_eos=True, timeout=60).token_ids
                  for p in prompts]
    results: list = [None] * len(prompts)

    def one(i: int) -> None:
        chunks = list(client.stream(token_ids=prompts[i], max_new_tokens=n, ignore_eos=True, timeout=120))
        results[i] = chunks

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert len({tuple(s) for s in sequential}) > 1  # the prompts really lead to different outputs
    for i, chunks in enumerate(results):
        assert chunks is not None, f"stream {i} did not finish"
        fin = chunks[-1].finish
        streamed = [t for c in chunks[:-1] for t in c.token_ids]
        assert fin.finish_reason == "length" and fin.usage.completion_tokens == n
        assert streamed == sequential[i], i  # nothing lost, duplicated or crossed between streams
    wait_kv_free(client)


def test_cancel_and_deadline_free_the_kv(served):
    _, client, _ = served
    wait_kv_free(client)
    long = dict(token_ids=[7, 8, 9], max_new_tokens=KV_TOKENS - 16, ignore_eos=True)
    # cancel: the client stops reading after the first chunk (the client cancels the call)
    stream = client.stream(timeout=120, **long)
    first = next(stream)
    assert first.token_ids
    busy = client.server_info()
    assert busy.running == 1 and busy.kv_used_tokens >= KV_TOKENS - 16
    stream.close()
    wait_kv_free(client)
    # deadline: the server aborts the request when the client's deadline passes
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        client.generate(timeout=0.5, **long)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 5
    wait_kv_free(client)
    # Abort by id from a second call
    rid = f"abort-me-{time.time_ns()}"
    out: dict = {}
    th = threading.Thread(target=lambda: out.setdefault("c", client.generate(request_id=rid, timeout=120, **long)))
    th.start()
    deadline = time.monotonic() + 30
    while client.server_info().running == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.abort(rid)
    th.join(timeout=30)
    assert out["c"].finish_reason == "abort" and out["c"].request_id == rid
    assert len(out["c"].token_ids) < KV_TOKENS - 16
    wait_kv_free(client)
    assert not client.abort(rid)  # finished: nothing to abort


def test_model_info_reflection_and_metrics(served):
    srv, client, _ = served
    info = client.model_info()
    assert info.vocab_size == 128 and info.max_positions == MAX_POS and info.has_tokenizer
    assert "dense" in info.methods and "psaw" in info.methods
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    services = ProtoReflectionDescriptorDatabase(client.channel).get_services()
    assert "raysparse.v1.RaySparse" in services and "grpc.health.v1.Health" in services
    before = _metric(srv, 'raysparse_requests_total{method="streaming",outcome="length"}') or 0.0
    for _ in range(2):
        # the tiny model's 2 layers are both dense by default: a sparse density needs them sparse, and a prompt
        # long enough for its sink and diagonal blocks to fit the budget
        client.generate(token_ids=list(range(5, 90)) * 3, method="streaming",
                        method_params={"density": 0.3, "dense_layers": [], "block_size": 16, "sink_tokens": 16},
                        max_new_tokens=4, ignore_eos=True, timeout=60)
    assert _metric(srv, 'raysparse_requests_total{method="streaming",outcome="length"}') == before + 2
    assert _metric(srv, 'raysparse_generation_tokens_total{method="streaming"}') >= 8
    assert _metric(srv, 'raysparse_kv_cache_capacity_tokens') == KV_TOKENS
    label = 'raysparse_attention_density{method="streaming{block_size=16,dense_layers=(),density=0.3,sink_tokens=16}"'
    # The gauges are polled: a poll that lands between a request's prefill and its first decode step shows
    # "all" near 0.3 with no decode series yet, so wait until every phase has a value within the budget.
    deadline = time.monotonic() + 10
    while True:
        got = {phase: _metric(srv, f'{label},phase="{phase}"}}') for phase in ("all", "prefill", "decode")}
        if all(v is not None and abs(v - 0.3) <= 0.01 for v in got.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for phase, value in got.items():  # each phase on its own, within the budget too
        assert value is not None and value == pytest.approx(0.3, abs=0.01), (phase, value)


def _metric(srv, name: str) -> float | None:
    body = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_a_shard_killed_while_idle_turns_health_not_serving_within_5_s(served):
    """No request runs: the replica's liveness check finds the dead shard, health goes NOT_SERVING (within 5 s)
    until the group is rebuilt, the error names the shard in plain text, and serving resumes."""
    import ray

    srv, client, _ = served
    wait_kv_free(client)
    rebuilds = srv.engine.server_info()["replicas"][0]["rebuilds"]
    shard = srv.engine.server_info()["replicas"][0]["shards"][0]["name"]
    seen: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(client.health())
            time.sleep(0.02)

    assert client.health() == "SERVING"
    ray.kill(ray.get_actor(shard))
    t0 = time.monotonic()
    w = threading.Thread(target=watch)
    w.start()
    try:
        while client.health() != "NOT_SERVING":
            assert time.monotonic() - t0 < 5, "health never went NOT_SERVING"
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as e:  # the only replica is rebuilding
            client.generate(token_ids=[4, 5, 6], max_new_tokens=4, timeout=60)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        client.wait_serving(180, poll_s=0.05)
        time.sleep(0.2)
    finally:
        stop.set()
        w.join()
    assert "NOT_SERVING" in seen and seen[-1] == "SERVING"
    last_down = len(seen) - 1 - seen[::-1].index("NOT_SERVING")
    assert all(s == "SERVING" for s in seen[last_down + 1:])
    info = client.server_info().replicas[0]
    assert info.rebuilds == rebuilds + 1
    assert f"shard actor {shard} of replica 0 died" in info.last_error and "\x1b" not in info.last_error
    ok = client.generate(token_ids=[4, 5, 6], max_new_tokens=4, ignore_eos=True, timeout=60)
    assert ok.finish_reason == "length" and len(ok.token_ids) == 4


def test_a_shard_killed_mid_stream_fails_it_with_the_shards_name_and_retries_what_had_not_started(served):
    """A stream with tokens out fails, naming the dead shard in plain text; a request that was still waiting
    for its turn is served by the rebuilt group, and its caller never sees the failure."""
    import ray

    srv, client, _ = served
    wait_kv_free(client)
    shard = srv.engine.server_info()["replicas"][0]["shards"][0]["name"]
    out: dict = {}
    # The running one holds the whole KV cache, so the second waits for pages: it has not started.
    running = client.stream(token_ids=[7, 8, 9], max_new_tokens=KV_TOKENS - 16, ignore_eos=True, timeout=120)
    first = next(running)
    assert first.token_ids
    th = threading.Thread(target=lambda: out.setdefault("w", client.generate(
        token_ids=[4, 5, 6], max_new_tokens=6, ignore_eos=True, timeout=120)))
    th.start()
    deadline = time.monotonic() + 30
    while client.server_info().waiting == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ray.kill(ray.get_actor(shard))
    fin = [c for c in running][-1].finish
    assert fin.finish_reason == "error" and f"shard actor {shard} of replica 0 died" in fin.error
    assert "\x1b" not in fin.error
    th.join(timeout=180)
    assert out["w"].finish_reason == "length" and len(out["w"].token_ids) == 6
    client.wait_serving(180, poll_s=0.05)
    wait_kv_free(client)


def test_serve_and_generate_commands(tmp_path):
    """`raysparse serve` in its own process, `raysparse generate` against it, SIGTERM drains and exits 0."""
    import json
    import os
    import signal
    import subprocess
    import sys

    from raysparse.serving.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny", max_positions=MAX_POS)
    port, mport = free_port(), free_port()
    cli = [sys.executable, "-m", "raysparse.cli"]
    server = subprocess.Popen([*cli, "serve", "--model", str(model), "--port", str(port), "--metrics-port", str(mport),
                               "--num-cpus", "2", "--cpus-per-shard", "0.5", "--no-draft", "--kv-cache-tokens", "1024"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
    try:
        with RaySparseClient(f"127.0.0.1:{port}") as c:
            c.wait_serving(120)
            ref = c.generate(token_ids=[9, 8, 7, 6], max_new_tokens=6, ignore_eos=True)
        out = subprocess.run([*cli, "generate", "--target", f"127.0.0.1:{port}", "--token-ids", "9,8,7,6",
                              "--max-new-tokens", "6", "--ignore-eos", "--json"], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        res = json.loads(out.stdout)
        assert res["token_ids"] == ref.token_ids and res["finish_reason"] == "length"
        assert res["density_prefill"] == 1.0 and res["density_decode"] == 1.0 and res["cached_tokens"] == 0  # dense
        streamed = subprocess.run([*cli, "generate", "--target", f"127.0.0.1:{port}", "--max-new-tokens", "5",
                                   "--ignore-eos", "Hello"], capture_output=True, text=True, timeout=120)
        assert streamed.returncode == 0 and "[length: 5 prompt + 5 tokens" in streamed.stderr
        assert "density prefill 1.000, decode 1.000]" in streamed.stderr
        bad = subprocess.run([*cli, "generate", "--target", f"127.0.0.1:{port}", "--token-ids", "1",
                              "--method", "streaming", "--density", "2"], capture_output=True, text=True, timeout=120)
        assert bad.returncode == 1 and bad.stderr.startswith("raysparse: error: INVALID_ARGUMENT")  # the server's
        unknown = subprocess.run([*cli, "generate", "--target", f"127.0.0.1:{port}", "--token-ids", "1",
                                  "--method", "no_such_method"], capture_output=True, text=True, timeout=120)
        assert unknown.returncode == 2 and "unknown attention method" in unknown.stderr  # refused before the call
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=30)
    log = server.stdout.read() if server.stdout else ""
    assert f"listening on 127.0.0.1:{port}" in log and "draining" in log


def test_committed_stubs_match_the_proto(tmp_path):
    """The generated files are what the documented protoc command makes of the proto today."""
    pytest.importorskip("grpc_tools")
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    rel = Path("raysparse/serving/proto")
    (tmp_path / rel).mkdir(parents=True)
    shutil.copy(root / rel / "raysparse.proto", tmp_path / rel)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.", "--grpc_python_out=.",
                    "--pyi_out=.", str(rel / "raysparse.proto")], cwd=tmp_path, check=True, timeout=120)
    for name in ("raysparse_pb2.py", "raysparse_pb2_grpc.py", "raysparse_pb2.pyi"):
        assert (tmp_path / rel / name).read_text() == (root / rel / name).read_text(), f"{name} is stale"


def test_the_shards_of_a_server_started_instance_split_its_cores(served):
    """The server starts the local Ray instance before the engine joins it; the engine's CPU shards still split
    that instance's cores (here num_cpus=2, one shard: 2 threads), as when the engine starts Ray itself."""
    srv, _, _ = served
    threads = srv.engine.runners[0].group.call("__ray_call__", lambda worker: torch.get_num_threads())
    assert threads == [2]
