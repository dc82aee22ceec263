"""SpecAttn's separate draft model in the engine (a local Ray instance, CPU): the draft actor loads the draft
checkpoint (another depth and KV head count), the TP=2 shards verify; p = 1 is plain greedy decoding, and a
draft that does not share the verifier's vocabulary is refused before any actor starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_helpers import run
from helpers import random_state, tiny_hf_config

from raysparse.orchestration.engine import Engine, EngineConfig, EngineRequest
from raysparse.orchestration.engine_api import InvalidRequestError
from raysparse.sampling import SamplingParams

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def _save(tmp_path_factory, name: str, **cfg_kw) -> str:
    cfg = tiny_hf_config(**cfg_kw)
    path = tmp_path_factory.mktemp(name)
    random_state(cfg, seed=int(torch.randint(0, 2**31 - 1, ()).item())).save_pretrained(path)
    return str(path)


def test_engine_with_a_separate_draft_matches_greedy(tmp_path_factory):
    print(f"torch seed {torch.seed()}")
    verifier = _save(tmp_path_factory, "verifier", num_kv_heads=2, group=2, layers=5)
    draft = _save(tmp_path_factory, "draft", num_kv_heads=1, group=3, layers=2)
    other = _save(tmp_path_factory, "other", num_kv_heads=1, group=2, layers=2)
    cfg = json.loads((Path(other) / "config.json").read_text())
    cfg["vocab_size"] = 50
    (Path(other) / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="vocabulary of 50 tokens"):
        Engine(EngineConfig(model=verifier, draft_model=other, num_cpus=1)).start()

    eng = Engine(EngineConfig(model=verifier, tp=2, kv_cache_tokens=2048, cpus_per_shard=0.5,
                              draft_model=draft)).start()
    try:
        g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
        ps = [tuple(torch.randint(0, 97, (n,), generator=g).tolist()) for n in (130, 61)]
        greedy = run(eng, "dense", {}, ps, 9)
        outs = []
        for p in ps:
            fin = eng.submit(EngineRequest(p, SamplingParams(max_new_tokens=9, ignore_eos=True), "specattn",
                                           {"top_p": 1.0})).result(120)
            assert fin.finish_reason == "length", fin.error
            outs.append(fin.token_ids)
        assert outs == greedy
        fin = eng.submit(EngineRequest(ps[0], SamplingParams(max_new_tokens=9, ignore_eos=True), "specattn",
                                       {"top_p": 0.5})).result(120)
        assert fin.finish_reason == "length" and len(fin.token_ids) == 9, fin.error
        st = eng.runners[0].spec_step.stats()
        assert st["rounds"] > 0 and st["bytes_per_round"] > 0
        with pytest.raises(InvalidRequestError, match="temperature must be 0"):
            eng.submit(EngineRequest(ps[0], SamplingParams(max_new_tokens=3, temperature=0.8), "specattn"))
    finally:
        eng.shutdown()
