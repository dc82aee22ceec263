"""Perplexity the way a decode method is exercised: teacher-forced decoding over the end of a window.

A decode-time method (SOCKET, CIS, SpecAttn's verifier, PSAW's decode) runs a dense or its own prefill, so
the prefill perplexity of the harness cannot see its decode selection. Here, for a window of n tokens and
m scored tokens, the first p = n - 1 - m tokens are prefilled through the backend (its prefill path), then
the tokens at positions p..n-2 are fed one decode step at a time and each step's logits score the next
true token: the m targets ids[p + 1:] are all predicted by decode steps, with the method's decode
attention in every one of them (and its metering and tracing, as in generation).

SpecAttn decodes in verification chunks instead: per round, the draft runs over the next true tokens (its
attention rows choose the chunks, as in generation), the cache rolls back, and the verifier checks up to
gamma + 1 true tokens at once with the draft-selected chunks; every verified position's logits score the
next true token. With the true tokens as the draft nothing is ever rejected, so acceptance is not measured
here (it comes from the generation tasks); the verifier's KV reads are. A separate draft model
(``SeparateDraft``) prefills the window's first p tokens into its own cache and reads the same true tokens
teacher-forced (``teacher_rows``), then takes in the round's last verified token, so its cache always holds
the verified tokens; its rows pick the chunks through the backend's layer map.

Dense is exact by construction: one prefill with every position's logits scores the same targets.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from raysparse.attention import AttentionBackend, DenseAttention
from raysparse.kv_cache import KVCache
from raysparse.model import LlamaForCausalLM


def scored_span(n: int, tokens: int) -> tuple[int, int]:
    """(p, m): prefill p tokens, score m = min(tokens, n - 2) targets (p >= 1, so decode has a context)."""
    if n < 3:
        raise ValueError(f"a window of {n} tokens is too short for decode perplexity")
    m = min(tokens, n - 2)
    return n - 1 - m, m


@torch.inference_mode()
def decode_nll(model: LlamaForCausalLM, cache: KVCache, backend: AttentionBackend, ids: list[int], tokens: int,
               seq_id: int, draft: Any | None = None) -> tuple[float, int]:
    """Summed NLL (nats) of the last ``tokens`` tokens of ``ids`` predicted by decode steps, and their count.
    Allocates ``seq_id`` in ``cache`` and frees it (and the backend's state for it) before returning.
    ``draft``: SpecAttn's separate draft model (None: the self-speculative draft)."""
    n = len(ids)
    p, m = scored_span(n, tokens)
    cache.allocate(seq_id, n)
    try:
        dev = cache.device
        ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
        if isinstance(backend, DenseAttention):
            logits = model(ids_t, cache.prepare([seq_id], [n], True), cache, backend, all_logits=True)
            return float(F.cross_entropy(logits[p:n - 1], ids_t[p + 1:], reduction="sum")), m
        model(ids_t[:p], cache.prepare([seq_id], [p], True), cache, backend)
        if backend.speculative:
            if draft is None:
                return _verify_chunks(model, cache, backend, ids_t, p, seq_id), m
            draft.prefill([(seq_id, n, ids[:p])])
            try:
                return _verify_chunks(model, cache, backend, ids_t, p, seq_id, draft), m
            finally:
                draft.free([seq_id])
        total = torch.zeros((), dtype=torch.float32, device=dev)
        for j in range(p, n - 1):
            logits = model(ids_t[j:j + 1], cache.prepare([seq_id], [1], False), cache, backend)
            total += F.cross_entropy(logits[-1:].float(), ids_t[j + 1:j + 2], reduction="sum")
        return float(total), m
    finally:
        cache.free(seq_id)
        backend.release(seq_id)


def _verify_chunks(model: LlamaForCausalLM, cache: KVCache, backend: Any, ids: torch.Tensor, p: int,
                   seq_id: int, draft: Any | None = None) -> float:
    """SpecAttn rounds over ids[p:], the true tokens as the draft; returns the summed NLL of ids[p + 1:]."""
    from raysparse.specattn.draft import AttentionProbe, draft_forward

    n, gamma = ids.shape[0], backend.config.gamma
    needed = backend.needed_draft_layers()
    probe = AttentionProbe(model.cfg.num_layers, needed)
    total = torch.zeros((), dtype=torch.float32, device=ids.device)
    t = p
    backend.clear_plans()
    while t < n - 1:
        g = min(gamma, n - 2 - t)  # verify ids[t..t+g]; their targets ids[t+1..t+g+1] stay inside the window
        rows: dict[int, list[torch.Tensor]] = {d: [] for d in needed}
        if draft is not None:
            steps = ids[t:t + max(g, 1)].tolist()  # a last one-token round still needs one draft row
            rows = draft.teacher_rows(seq_id, steps, needed)
            draft.feed(seq_id, ids[t + len(steps):t + g + 1].tolist())  # in step with the verifier's t + g + 1
        elif needed:
            for s in range(max(g, 1)):  # a last one-token round still needs one draft row for its plan
                draft_forward(model, backend.draft_layers, ids[t + s:t + s + 1],
                              cache.prepare([seq_id], [1], False), cache, probe)
                for d in needed:
                    rows[d].append(probe.take(d, seq_id))
            cache.truncate(seq_id, t)
        backend.plan(seq_id, t, g + 1, rows)
        try:
            logits = model(ids[t:t + g + 1], cache.prepare([seq_id], [g + 1], True), cache, backend,
                           all_logits=True)
        finally:
            backend.clear_plans()
        total += F.cross_entropy(logits, ids[t + 1:t + g + 2], reduction="sum")
        t += g + 1
    return float(total)
