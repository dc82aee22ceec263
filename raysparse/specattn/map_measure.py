"""Measuring SpecAttn's layer map: the verifier's and the draft's attention rows on real text, their
similarity sums and the map aligned from them.

How the distributions are probed (``compute_layer_map``): each text window's prefix is prefilled densely
into one KV cache, then for ``steps`` further tokens of the real text (teacher forced) the draft takes a
decode step exactly as it does while serving (its own queries over the shared cache, see ``draft``),
the cache is rolled back, and the verifier takes the same step densely. Both record their attention rows.
So the similarities are measured on the same kind of rows the draft produces at serve time.

The similarities are sums over windows and KV heads divided once (``dtw.similarity_sums``), so the windows
can be spread over replicas (``map_from_sums`` adds them in window order) and the KV heads over
tensor-parallel shards (all-reduced); ``raysparse specattn-map`` (``map_engine.py``) does so on the engine's
shard actors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from raysparse.attention import DenseAttention
from raysparse.kv_cache import KVCache
from raysparse.model import LlamaForCausalLM
from raysparse.specattn.draft import AttentionProbe, default_draft_layers, draft_forward, validate_draft_layers
from raysparse.specattn.dtw import monotone_dtw, similarity_sums
from raysparse.specattn.layer_map import LayerMap


def probe_attention(model: LlamaForCausalLM, windows: Sequence[Sequence[int]], draft_layers: Sequence[int],
                    steps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention rows of the verifier (every layer) and the draft (its layers) on the last ``steps`` tokens
    of each window: ([L, R, h_kv, n_max], [m, R, h_kv, n_max]), R = windows * steps, zero padded."""
    draft = validate_draft_layers(draft_layers, model.cfg.num_layers)
    L = model.cfg.num_layers
    if steps < 1:
        raise ValueError("steps must be >= 1")
    windows = [list(w) for w in windows]
    if not windows or any(len(w) < steps + 1 for w in windows):
        raise ValueError(f"every window needs more than steps={steps} tokens")
    dev = model.lm_head.weight.device
    longest = max(len(w) for w in windows)
    page = 16
    cache = KVCache(model.cfg, -(-longest // page) + 1, page, model.lm_head.weight.dtype, dev, model.num_kv_heads)
    dense = DenseAttention(L)
    v_probe, d_probe = AttentionProbe(L, range(L)), AttentionProbe(L, draft)
    v_rows: list[list[torch.Tensor]] = [[] for _ in range(L)]
    d_rows: list[list[torch.Tensor]] = [[] for _ in draft]
    sid = -1  # not a Generator id
    for w in windows:
        cache.allocate(sid, len(w))
        try:
            prefix = len(w) - steps
            batch = cache.prepare([sid], [prefix], True)
            model(torch.tensor(w[:prefix], device=dev), batch, cache, dense)
            for t in range(prefix, len(w)):
                tok = torch.tensor([w[t]], device=dev)
                batch = cache.prepare([sid], [1], False)
                draft_forward(model, draft, tok, batch, cache, d_probe)
                cache.truncate(sid, t)
                batch = cache.prepare([sid], [1], False)
                model(tok, batch, cache, v_probe)
                for j in range(L):
                    v_rows[j].append(v_probe.take(j, sid))
                for i, d in enumerate(draft):
                    d_rows[i].append(d_probe.take(d, sid))
        finally:
            cache.free(sid)
    n_max = max(r.shape[-1] for r in v_rows[0])

    def stack(rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([torch.nn.functional.pad(r.float().cpu(), (0, n_max - r.shape[-1])) for r in rows])

    return torch.stack([stack(r) for r in v_rows]), torch.stack([stack(r) for r in d_rows])


def probe_cross_attention(model: LlamaForCausalLM, draft: LlamaForCausalLM, windows: Sequence[Sequence[int]],
                          steps: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``probe_attention`` for a separate draft model: both models prefill each window's prefix densely into
    caches of their own and take the last ``steps`` tokens as teacher-forced decode steps, recording every
    layer's row. The draft's rows are mapped onto the verifier's KV heads as at serve time
    (``draft_model.to_verifier_heads``), then cut to the KV heads ``model`` holds (a tensor-parallel shard:
    its own). Returns ([L, R, h_kv, n_max], [m, R, h_kv, n_max])."""
    from raysparse.specattn.draft_model import to_verifier_heads

    if steps < 1:
        raise ValueError("steps must be >= 1")
    windows = [list(w) for w in windows]
    if not windows or any(len(w) < steps + 1 for w in windows):
        raise ValueError(f"every window needs more than steps={steps} tokens")
    L, m = model.cfg.num_layers, draft.cfg.num_layers
    lo = getattr(model, "kv_head_offset", 0)
    hi = lo + model.num_kv_heads
    longest, page = max(len(w) for w in windows), 16
    caches, probes, rows = [], [], []
    for mdl in (model, draft):
        dev, dtype = mdl.lm_head.weight.device, mdl.lm_head.weight.dtype
        caches.append(KVCache(mdl.cfg, -(-longest // page) + 1, page, dtype, dev, mdl.num_kv_heads))
        probes.append(AttentionProbe(mdl.cfg.num_layers, range(mdl.cfg.num_layers)))
        rows.append([[] for _ in range(mdl.cfg.num_layers)])
    sid = -1  # not a Generator id
    for w in windows:
        prefix = len(w) - steps
        for mdl, cache in zip((model, draft), caches, strict=True):
            cache.allocate(sid, len(w))
            dev = mdl.lm_head.weight.device
            mdl(torch.tensor(w[:prefix], device=dev), cache.prepare([sid], [prefix], True), cache,
                DenseAttention(mdl.cfg.num_layers))
        try:
            for t in range(prefix, len(w)):
                for k, (mdl, cache, probe) in enumerate(zip((model, draft), caches, probes, strict=True)):
                    tok = torch.tensor([w[t]], device=mdl.lm_head.weight.device)
                    mdl(tok, cache.prepare([sid], [1], False), cache, probe)
                    for j in range(mdl.cfg.num_layers):
                        r = probe.take(j, sid)
                        if k == 1:
                            r = to_verifier_heads(r, model.cfg.num_kv_heads)[lo:hi]
                        rows[k][j].append(r)
        finally:
            for cache in caches:
                cache.free(sid)
    n_max = max(r.shape[-1] for r in rows[0][0])

    def stack(rs: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([torch.nn.functional.pad(r.float().cpu(), (0, n_max - r.shape[-1])) for r in rs])

    assert L == len(rows[0]) and m == len(rows[1])
    return torch.stack([stack(r) for r in rows[0]]), torch.stack([stack(r) for r in rows[1]])


def cross_window_similarity(model: LlamaForCausalLM, draft: LlamaForCausalLM, window: Sequence[int],
                            steps: int = 8) -> tuple[torch.Tensor, int]:
    """``similarity_sums`` of one window for a separate draft, over the KV heads ``model`` holds."""
    return similarity_sums(*probe_cross_attention(model, draft, [window], steps))


def window_similarity(model: LlamaForCausalLM, window: Sequence[int], draft_layers: Sequence[int],
                      steps: int = 8) -> tuple[torch.Tensor, int]:
    """``similarity_sums`` of one text window over the KV heads ``model`` holds (a shard: its own)."""
    return similarity_sums(*probe_attention(model, [window], draft_layers, steps))


def _dtw_from_sums(parts: Sequence[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, list[int], float]:
    """The mean similarity of every window's sums (added in window order) and its DTW path and score."""
    total, terms = parts[0][0].clone(), parts[0][1]
    for s, n in parts[1:]:
        total, terms = total + s, terms + n
    sim = (total / terms).float()
    path, score = monotone_dtw(sim)
    return sim, path, score


def map_from_sums(parts: Sequence[tuple[torch.Tensor, int]], num_layers: int, draft_layers: Sequence[int],
                  steps: int, source: str, window_tokens: Sequence[int]) -> LayerMap:
    """The map from every window's similarity sums (summed over shards), added in window order, by DTW."""
    sim, path, score = _dtw_from_sums(parts)
    draft = tuple(draft_layers)
    return LayerMap(num_layers, draft, tuple(draft[i] for i in path), tuple(tuple(r) for r in sim.tolist()), source,
                    {"score": score, "windows": len(parts), "steps": steps, "window_tokens": list(window_tokens)})


def cross_map_from_sums(parts: Sequence[tuple[torch.Tensor, int]], num_layers: int, draft_num_layers: int,
                        draft: str, steps: int, source: str, window_tokens: Sequence[int]) -> LayerMap:
    """``map_from_sums`` for a separate draft (rows: the draft's layers 0..m-1)."""
    sim, path, score = _dtw_from_sums(parts)
    if sim.shape[0] != draft_num_layers:
        raise ValueError(f"similarities of {sim.shape[0]} draft layers for a draft of {draft_num_layers}")
    return LayerMap(num_layers, tuple(range(draft_num_layers)), tuple(path), tuple(tuple(r) for r in sim.tolist()),
                    source, {"score": score, "windows": len(parts), "steps": steps,
                             "window_tokens": list(window_tokens)}, draft, draft_num_layers)


def compute_cross_layer_map(model: LlamaForCausalLM, draft: LlamaForCausalLM, windows: Sequence[Sequence[int]],
                            key: str, steps: int = 8, source: str = "") -> LayerMap:
    """``compute_layer_map`` for a separate draft model of any depth and head count (all-reduced over the
    verifier's tensor-parallel shards, as there)."""
    parts = [cross_window_similarity(model, draft, w, steps) for w in windows]
    parts = _all_reduce_parts(model, parts)
    return cross_map_from_sums(parts, model.cfg.num_layers, draft.cfg.num_layers, key, steps, source,
                               [len(w) for w in windows])


def _all_reduce_parts(model: LlamaForCausalLM, parts: list[tuple[torch.Tensor, int]]) -> list[tuple[torch.Tensor, int]]:
    if getattr(model, "tp_world_size", 1) <= 1:
        return parts
    import torch.distributed as dist

    for s, _ in parts:
        dist.all_reduce(s, op=dist.ReduceOp.SUM)
    terms = torch.tensor([n for _, n in parts], dtype=torch.float64, device=parts[0][0].device)
    dist.all_reduce(terms, op=dist.ReduceOp.SUM)
    return [(s, int(n)) for (s, _), n in zip(parts, terms.tolist(), strict=True)]


def compute_layer_map(model: LlamaForCausalLM, windows: Sequence[Sequence[int]],
                      draft_layers: Sequence[int] | None = None, steps: int = 8, source: str = "") -> LayerMap:
    """Measures S on the token ``windows`` (real text) and aligns the layers by ``monotone_dtw``. On a
    tensor-parallel shard (every rank calls it) the shards' sums are all-reduced, so every rank gets the
    map of the whole model."""
    L = model.cfg.num_layers
    draft = validate_draft_layers(default_draft_layers(L) if draft_layers is None else draft_layers, L)
    parts = _all_reduce_parts(model, [window_similarity(model, w, draft, steps) for w in windows])
    return map_from_sums(parts, L, draft, steps, source, [len(w) for w in windows])


def text_windows(tokenizer: Any, text: str, windows: int, tokens: int) -> list[list[int]]:
    """``windows`` token windows of ``tokens`` tokens from evenly spaced places of ``text``."""
    out: list[list[int]] = []
    span = max(1, len(text) // max(windows, 1))
    for w in range(windows):
        start = w * span
        piece = text[start: start + 12 * tokens]
        ids = tokenizer(piece, add_special_tokens=False)["input_ids"][:tokens]
        if len(ids) >= tokens:
            out.append(ids)
    if not out:
        raise ValueError(f"the text is too short for a window of {tokens} tokens")
    return out

