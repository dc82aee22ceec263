"""The engine with the default model (SmolLM2-135M: 3 KV heads, so TP=2 splits them 2 + 1): TP=2 greedy
outputs and selections equal TP=1's on a real-text prompt, and the main job's flags reach the engine."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import SHARED_SELECTION, assert_same_selections, record_selections, run, tp1_and_tp2

from raysparse.step_plan import method_key

pytestmark = pytest.mark.timeout(900)
# 0.4 of the whole model (2 of its 30 layers dense): its 600-token prompt's sink and diagonal blocks fit
CASES = [("dense", {}), ("sketch_walk", {"density": 0.4}), ("quest", {"density": 0.4})]


@pytest.fixture(scope="module")
def engines():
    from raysparse.loader import resolve_source

    try:
        resolve_source(None)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    yield from tp1_and_tp2(kv_cache_tokens=2048, cpus_per_shard=0.5, draft=False)


@pytest.mark.parametrize("method, params", CASES)
def test_default_model_tp2_matches_tp1(engines, real_text, method, params):
    e1, e2 = engines
    start = int(torch.randint(0, len(real_text) - 20000, ()))
    prompt = tuple(e1.tokenizer(real_text[start: start + 20000])["input_ids"][:600])
    if method != "dense":
        for e in engines:
            record_selections(e, method_key(method, params))
    assert run(e2, method, params, [prompt], new=8) == run(e1, method, params, [prompt], new=8)
    if method != "dense":
        assert_same_selections(e1, e2, method in SHARED_SELECTION)
