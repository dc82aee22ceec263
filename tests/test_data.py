"""Ray Data batch inference through raysparse engines (``raysparse.data``) on a local two-node Ray cluster (CPU):
JSONL and Parquet datasets through a pool of two engine actors, every answer the model's greedy one, bad rows
as ``error`` rows."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("pandas")  # Ray Data's own dependency

from serving_helpers import reference_greedy  # noqa: E402

N_NEW = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import ray
    from ray.cluster_utils import Cluster

    from raysparse.orchestration.ray_env import WORKER_ENV

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    c.add_node(num_cpus=2)
    ray.init(address=c.address, runtime_env={"env_vars": WORKER_ENV})
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.mark.slow  # about 2.5 min on 2 cores
def test_jsonl_and_parquet_datasets_through_two_engine_actors(cluster, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray.data

    from raysparse.data.processor import ProcessorConfig, build_processor
    from raysparse.serving.tiny import CHAT_TEMPLATE, write_tiny_model

    model = write_tiny_model(tmp_path / "tiny", chat_template=CHAT_TEMPLATE)
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 98) for _ in range(rng.randrange(3, 40))] for _ in range(64)]
    rows = [{"id": f"p{i}", "prompt_ids": p} for i, p in enumerate(prompts)]
    bad = [{"id": "bad-token", "prompt_ids": [10_000]}, {"id": "bad-method", "prompt_ids": [5, 6],
                                                         "method": "no_such_method"},
           {"id": "empty", "prompt_ids": []}, {"id": "both", "prompt": "hi", "prompt_ids": [5]}]
    text = [{"id": "text", "prompt": "Where is the gate?"},
            {"id": "chat", "messages": [{"role": "user", "content": "Open the gate"}]},
            {"id": "doc", "document": "The gate code is 4721.", "question": "What is the code?"}]
    everything = rows + text + bad
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in everything))
    parquet = tmp_path / "in.parquet"  # every column in every row (from_pylist takes the first row's keys)
    keys = {k: None for r in everything for k in r}
    pq.write_table(pa.Table.from_pylist([{**keys, **r} for r in everything]), parquet)
    proc = build_processor(ProcessorConfig(model=str(model), replicas=2, batch_size=8,
                                           sampling={"max_new_tokens": N_NEW, "ignore_eos": True},
                                           engine={"cpus_per_shard": 0.5, "kv_cache_tokens": 1024, "draft": False,
                                                   "load_timeout_s": 120}))
    want = {f"p{i}": reference_greedy(model, p, N_NEW) for i, p in enumerate(prompts)}
    # an engine loads for seconds: both actors up before the first block, or the first takes them all
    ray.data.DataContext.get_current().wait_for_min_actors_s = 300
    # a small file reads as one block, which one actor would take whole: eight blocks for the pool of two
    for source in (ray.data.read_json(str(jsonl)).repartition(8), ray.data.read_parquet(str(parquet)).repartition(8)):
        out = {r["id"]: r for r in proc(source).take_all()}
        assert len(out) == len(everything), seed
        assert len({r["engine"] for r in out.values()}) == 2  # both engine actors served rows
        for rid, ids in want.items():
            r = out[rid]
            assert r["error"] is None and r["finish_reason"] == "length", (seed, r)
            assert list(r["generated_token_ids"]) == ids, (seed, rid)
            assert r["num_input_tokens"] == len(prompts[int(rid[1:])]) and r["num_generated_tokens"] == N_NEW
        for t in text:  # text, chat messages, a document and its question: the chat template's prompt
            r = out[t["id"]]
            assert r["error"] is None and r["num_generated_tokens"] == N_NEW and r["num_input_tokens"] > 10, r
        for b in bad:
            r = out[b["id"]]
            assert r["finish_reason"] == "error" and r["error"] and "\n" not in r["error"], r
        assert "vocabulary" in out["bad-token"]["error"] and "no_such_method" in out["bad-method"]["error"]
        assert "exactly one" in out["both"]["error"]
