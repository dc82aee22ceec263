"""Scoring one work item on a backend: a task sample by greedy generation, a perplexity window by one prefill.

``task_sample`` generates through ``Generator`` (prefill + a few decode steps), or through
``SpecAttnGenerator`` for a speculative backend (SpecAttn: with ``draft``, the separate draft model, else the
self-speculative draft), and scores the output exactly (``EvalTask.score``). ``window_nll`` runs one prefill
with all logits and sums the NLL of the last ``PPL_SCORED_FRACTION`` of the window. The teacher-forced decode
perplexity of a window is ``decode_ppl.decode_nll``. The harness (``harness.py``) calls these per item.
"""

from __future__ import annotations

from typing import Any

import torch

from raysparse.attention import AttentionBackend
from raysparse.eval.tasks import PPL_SCORED_FRACTION, EvalTask
from raysparse.generate import FinishEvent, GenerationRequest, Generator
from raysparse.kv_cache import KVCache
from raysparse.model import LlamaForCausalLM
from raysparse.sampling import SamplingParams


def task_sample(model: LlamaForCausalLM, cache: KVCache, backend: AttentionBackend, tokenizer: Any,
                task: EvalTask, max_new_tokens: int, draft: Any | None = None) -> dict[str, Any]:
    """Greedy generation of up to ``max_new_tokens`` on ``task``'s prompt, scored; raises if generation fails."""
    if backend.speculative:
        from raysparse.specattn.decode import SpecAttnGenerator

        gen: Generator = SpecAttnGenerator(model, cache, backend, tokenizer, draft=draft)  # type: ignore
    else:
        gen = Generator(model, cache, backend, tokenizer)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    finish = None
    for ev in gen.generate([GenerationRequest(task.prompt_ids, params, f"{task.name}-{task.seed}")]):
        if isinstance(ev, FinishEvent):
            finish = ev
    if finish is None or finish.finish_reason == "error":
        raise RuntimeError(f"generation failed on {task.name}: {finish.error if finish else 'no result'}")
    score = task.score(finish.text)
    return {"task": task.name, "seed": task.seed, "prompt_tokens": len(task.prompt_ids),
            "expected": list(task.expected), "output": finish.text, "score": score}


def window_nll(model: LlamaForCausalLM, cache: KVCache, backend: AttentionBackend, ids: list[int],
               sid: int) -> tuple[float, int]:
    """Summed NLL (nats) of the scored last part of one window under ``backend``, and its token count.
    ``sid``: a fresh sequence id, freed (cache and backend state) before returning."""
    n = len(ids)
    cache.allocate(sid, n)
    try:
        batch = cache.prepare([sid], [n], True)
        dev = cache.device
        logits = model(torch.tensor(ids, device=dev), batch, cache, backend, all_logits=True)
    finally:
        cache.free(sid)
        backend.release(sid)
    first = n - max(1, int(n * PPL_SCORED_FRACTION))  # the first position whose next token is scored
    targets = torch.tensor(ids[first + 1:], device=logits.device)
    nll = torch.nn.functional.cross_entropy(logits[first:n - 1], targets, reduction="sum")
    return float(nll), len(targets)
