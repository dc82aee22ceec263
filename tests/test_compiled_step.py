"""Decode steps through a Ray compiled graph (forced on, as GPU groups use it): the same greedy tokens as
plain actor calls at TP=2, and a shard killed mid-decode fails its request and the group is rebuilt."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import kill_shard_mid_request
from helpers import random_state, tiny_hf_config

from raysparse.orchestration.engine import Engine, EngineConfig, EngineRequest
from raysparse.runtime_config import RuntimeConfig
from raysparse.sampling import SamplingParams

pytestmark = pytest.mark.timeout(600)


def _prompts() -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    # long enough for Sketch&Walk's sink and local blocks to fit its budget (64-token blocks)
    return [tuple(torch.randint(0, 97, (n,), generator=g).tolist()) for n in (700, 500)]


def _generate(engine: Engine, ps: list[tuple[int, ...]], method: str, params: dict) -> list[tuple[int, ...]]:
    hs = [engine.submit(EngineRequest(p, SamplingParams(max_new_tokens=5, ignore_eos=True), method, params))
          for p in ps]
    return [h.result(120).token_ids for h in hs]


# ~50 s on 2 cores; compiled graphs are a GPU path (``compiled_graph="auto"`` is off on CPUs)
@pytest.mark.slow
def test_compiled_decode_matches_plain_calls_and_survives_a_killed_shard(tmp_path):
    cfg = tiny_hf_config(num_kv_heads=2, group=2, layers=3)
    cfg.max_position_embeddings = 1024
    random_state(cfg, seed=int(torch.randint(0, 1000, ()))).save_pretrained(tmp_path)
    ps = _prompts()
    results = {}
    for mode in ("off", "on"):
        econf = EngineConfig(model=str(tmp_path), tp=2, kv_cache_tokens=2048, page_size=64, cpus_per_shard=0.5,
                             draft=False, decode_steps=2, name="compiled", runtime=RuntimeConfig(compiled_graph=mode))
        with Engine(econf) as eng:
            group = eng.runners[0].group
            results[mode] = [_generate(eng, ps, m, p) for m, p in (("dense", {}), ("sketch_walk", {"density": 0.8}))]
            assert (group._dag is not None) == (mode == "on")
            if mode == "off":
                continue
            kill_shard_mid_request(eng, ps[0], tokens_first=2)  # the second token: decoding in the graph
            assert _generate(eng, ps[:1], "dense", {}) == results["on"][0][:1]
    assert results["on"] == results["off"]
