"""Two Ray nodes on one machine (``ray.cluster_utils.Cluster``): one replica per node, both serving."""

from __future__ import annotations

import pytest
import torch
from helpers import random_state, tiny_hf_config

from raysparse.orchestration.engine import Engine, EngineConfig, EngineRequest
from raysparse.sampling import SamplingParams

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


def test_two_nodes_one_replica_each(cluster, tmp_path):
    model = random_state(tiny_hf_config(layers=3), seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    model.save_pretrained(tmp_path)
    cfg = EngineConfig(model=str(tmp_path), replicas=2, address=cluster.address, kv_cache_tokens=1024,
                       cpus_per_shard=1.0, draft=False)
    with Engine(cfg) as eng:
        reps = eng.server_info()["replicas"]
        nodes = {r["shards"][0]["node_id"] for r in reps}
        assert len(nodes) == 2, f"both replicas landed on one node: {reps}"
        prompt = tuple(range(5, 90))
        handles = [eng.submit(EngineRequest(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True)))
                   for _ in range(6)]
        outs = [h.result(120) for h in handles]
        assert all(o.finish_reason == "length" for o in outs)
        assert len({o.token_ids for o in outs}) == 1  # same weights, greedy: same answer on either node
        assert {o.stats["replica"] for o in outs} == {0, 1}  # the router used both replicas
