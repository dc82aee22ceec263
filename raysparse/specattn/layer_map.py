"""Layer mapping f: verifier layer -> draft layer, by monotone DTW over attention KL similarities.

S[i, j] = -KL(A_verifier_j || A_draft_i), where A are attention distributions over the context, averaged
over each KV group's query heads (the draft and the verifier have the same KV heads: the draft is the
verifier with a subset of its layers). KL is per KV head and per probed decode row, then averaged.

How the distributions are probed (``compute_layer_map``): each text window's prefix is prefilled densely
into one KV cache, then for ``steps`` further tokens of the real text (teacher forced) the draft takes a
decode step exactly as it does while serving (its own queries over the shared cache, see ``draft``),
the cache is rolled back, and the verifier takes the same step densely. Both record their attention rows.
So the similarities are measured on the same kind of rows the draft produces at serve time.

``monotone_dtw`` is the paper's Algorithm 3: maximise sum_j S[f(j), j] over non-decreasing f, with draft
layers allowed to be skipped or repeated and no constraint on the first or last draft layer used. Ties go
to the smaller draft layer. The map is saved as a small JSON file (``specattn_layer_map.json``) in the
model directory, or, when that is not writable, under the raysparse cache directory keyed by the model
directory's path; ``raysparse specattn-map`` (``map_command.py``) measures and saves it on the engine's shard
actors. The similarities are sums over windows and KV heads divided once (``similarity_sums``), so the
windows can be spread over replicas and the KV heads over tensor-parallel shards.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from raysparse.attention import DenseAttention
from raysparse.kv_cache import KVCache
from raysparse.model import LlamaForCausalLM
from raysparse.specattn.draft import AttentionProbe, default_draft_layers, draft_forward, validate_draft_layers

MAP_FILE = "specattn_layer_map.json"
FORMAT = "raysparse-specattn-layer-map"
VERSION = 1
_EPS = 1e-10


@dataclass(frozen=True)
class LayerMap:
    """``mapping[j]`` is the draft layer (a verifier layer index, one of ``draft_layers``) for verifier
    layer j."""

    num_layers: int
    draft_layers: tuple[int, ...]
    mapping: tuple[int, ...]
    similarity: tuple[tuple[float, ...], ...] = ()  # S[i, j], i over draft_layers, j over verifier layers
    source: str = ""
    info: dict[str, Any] = field(default_factory=dict, compare=False)
    draft: str = ""  # a separate draft model's key (``draft_model.draft_key``); "" = self-speculative
    draft_num_layers: int = 0  # a separate draft's depth (its layers are then 0 .. draft_num_layers - 1)

    def __post_init__(self) -> None:
        if self.draft:
            if self.draft_layers != tuple(range(self.draft_num_layers)) or self.draft_num_layers < 1:
                raise ValueError(f"a separate draft's layers are 0..{self.draft_num_layers - 1}, "
                                 f"got {list(self.draft_layers)}")
        else:
            validate_draft_layers(self.draft_layers, self.num_layers)
        if len(self.mapping) != self.num_layers:
            raise ValueError(f"layer map has {len(self.mapping)} entries for {self.num_layers} verifier layers")
        allowed = set(self.draft_layers)
        if any(m not in allowed for m in self.mapping):
            raise ValueError(f"layer map {list(self.mapping)} uses layers outside the draft {list(self.draft_layers)}")
        if any(a > b for a, b in zip(self.mapping, self.mapping[1:], strict=False)):
            raise ValueError(f"layer map {list(self.mapping)} is not monotone")

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "num_layers": self.num_layers,
                "draft_layers": list(self.draft_layers), "map": list(self.mapping),
                "similarity": [list(r) for r in self.similarity], "source": self.source,
                **({"draft": self.draft, "draft_num_layers": self.draft_num_layers} if self.draft else {}),
                **self.info}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LayerMap:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError("not a SpecAttn layer map file")
        if data.get("version") != VERSION:
            raise ValueError(f"unsupported layer map version {data.get('version')!r}")
        try:
            known = {"format", "version", "num_layers", "draft_layers", "map", "similarity", "source", "draft",
                     "draft_num_layers"}
            return cls(int(data["num_layers"]), tuple(int(x) for x in data["draft_layers"]),
                       tuple(int(x) for x in data["map"]),
                       tuple(tuple(float(x) for x in r) for r in data.get("similarity", ())),
                       str(data.get("source", "")), {k: v for k, v in data.items() if k not in known},
                       str(data.get("draft", "")), int(data.get("draft_num_layers", 0)))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed layer map: {e}") from None


def nearest_below_map(num_layers: int, draft_layers: Sequence[int]) -> LayerMap:
    """The fallback map when none was computed: each verifier layer reads the deepest draft layer at or
    below it (the draft's copy of the same weights where it has one)."""
    draft = validate_draft_layers(draft_layers, num_layers)
    mapping = tuple(max(d for d in draft if d <= j) for j in range(num_layers))
    return LayerMap(num_layers, draft, mapping, source="nearest draft layer at or below (no measured map)")


def proportional_map(num_layers: int, draft_num_layers: int, draft: str) -> LayerMap:
    """The fallback map of a separate draft when none was measured: verifier layer j reads the draft layer at
    the same relative depth, round(j * (m - 1) / (L - 1))."""
    m = draft_num_layers
    mapping = tuple(round(j * (m - 1) / (num_layers - 1)) if num_layers > 1 else 0 for j in range(num_layers))
    return LayerMap(num_layers, tuple(range(m)), mapping, source="same relative depth (no measured map)",
                    draft=draft, draft_num_layers=m)


# ---- DTW ---------------------------------------------------------------------------------------
def monotone_dtw(score: Sequence[Sequence[float]] | torch.Tensor) -> tuple[list[int], float]:
    """Monotone alignment of the columns (verifier layers) to rows (draft layers) of ``score`` [m, n]:
    returns f (length n, non-decreasing row indices) maximising sum_j score[f(j), j], and that sum."""
    s = score.tolist() if isinstance(score, torch.Tensor) else [list(map(float, r)) for r in score]
    m = len(s)
    n = len(s[0]) if m else 0
    if m == 0 or n == 0 or any(len(r) != n for r in s):
        raise ValueError("score must be a non-empty rectangular matrix")
    if any(not math.isfinite(x) for r in s for x in r):
        raise ValueError("score holds non-finite values")
    best = [[0.0] * n for _ in range(m)]
    back = [[0] * n for _ in range(m)]
    for i in range(m):
        best[i][0] = s[i][0]
    for j in range(1, n):
        run, arg = -math.inf, 0
        for i in range(m):  # best over predecessors k <= i (diagonal, repeat and skip moves alike)
            if best[i][j - 1] > run:
                run, arg = best[i][j - 1], i
            best[i][j] = s[i][j] + run
            back[i][j] = arg
    end = max(range(m), key=lambda i: (best[i][n - 1], -i))
    path = [end]
    for j in range(n - 1, 0, -1):
        path.append(back[path[-1]][j])
    return path[::-1], best[end][n - 1]


def kl_similarity(verifier_rows: torch.Tensor, draft_rows: torch.Tensor) -> torch.Tensor:
    """verifier_rows [L, R, h_kv, n], draft_rows [m, R, h_kv, n] (distributions over n, zero-padded).
    Returns S [m, L] = -mean over rows and heads of KL(A_verifier_j || A_draft_i)."""
    total, terms = similarity_sums(verifier_rows, draft_rows)
    return (total / terms).float()


def similarity_sums(verifier_rows: torch.Tensor, draft_rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(-sum over rows and KV heads of KL(A_verifier_j || A_draft_i) [m, L] in float64, the number of terms):
    sums over windows and over tensor-parallel shards (each holding some KV heads) add up to the mean."""
    pv = verifier_rows.double().clamp(min=0)
    pd = draft_rows.double().clamp(min=0)
    pv = pv / pv.sum(-1, keepdim=True).clamp(min=_EPS)
    pd = pd / pd.sum(-1, keepdim=True).clamp(min=_EPS)
    plogp = torch.where(pv > 0, pv * (pv.clamp(min=_EPS)).log(), torch.zeros_like(pv)).sum(-1)  # [L, R, h]
    logd = pd.clamp(min=_EPS).log()  # [m, R, h, n]
    cross = torch.einsum("lrhn,mrhn->mlrh", pv, logd)
    kl = plogp[None] - cross
    return -kl.sum(dim=(-1, -2)), kl.shape[-1] * kl.shape[-2]


# ---- measuring ---------------------------------------------------------------------------------
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


# ---- storage -----------------------------------------------------------------------------------
def map_file_name(draft: str = "") -> str:
    """The map's file name in the verifier's directory: ``MAP_FILE`` for the self-speculative draft,
    ``specattn_layer_map.<draft key>.json`` for a separate draft model (one file per draft)."""
    return MAP_FILE if not draft else f"{MAP_FILE[:-len('.json')]}.{draft}.json"


def cache_map_path(model_dir: str | os.PathLike[str], draft: str = "") -> Path:
    """Where the map of a model directory that is not writable lives, under the raysparse cache."""
    from raysparse.loader import cache_root

    d = Path(model_dir).expanduser().resolve()
    key = hashlib.sha1(str(d).encode()).hexdigest()[:12]
    return cache_root() / "specattn" / (f"{d.name}-{key}.json" if not draft else f"{d.name}-{key}.{draft}.json")


def map_candidates(model_dir: str | os.PathLike[str], draft: str = "") -> list[Path]:
    return [Path(model_dir).expanduser() / map_file_name(draft), cache_map_path(model_dir, draft)]


def save_layer_map(layer_map: LayerMap, path: str | os.PathLike[str] | None = None,
                   model_dir: str | os.PathLike[str] | None = None) -> Path:
    """Writes the map to ``path``, else into ``model_dir`` (falling back to the cache when that is not
    writable). Atomic (temporary file + rename). Returns the path written."""
    if path is None and model_dir is None:
        raise ValueError("save_layer_map needs a path or a model directory")
    targets = ([Path(path).expanduser()] if path is not None
               else map_candidates(model_dir, layer_map.draft))  # type: ignore[arg-type]
    payload = json.dumps(layer_map.to_json(), indent=1) + "\n"
    last: OSError | None = None
    for target in targets:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            tmp.write_text(payload, encoding="utf-8")
            os.replace(tmp, target)
            return target
        except OSError as e:
            last = e
    raise OSError(f"cannot write the layer map ({last})")


def load_layer_map(path: str | os.PathLike[str] | None = None, model_dir: str | os.PathLike[str] | None = None,
                   num_layers: int | None = None, draft_layers: Sequence[int] | None = None,
                   draft: str = "") -> LayerMap | None:
    """Reads a map from ``path`` or the first existing candidate of ``model_dir`` for ``draft`` (a separate
    draft's key; "" = self-speculative); None when there is none. Raises ValueError for an unreadable file
    or one made for another depth or draft."""
    if path is None and model_dir is None:
        raise ValueError("load_layer_map needs a path or a model directory")
    cands = ([Path(path).expanduser()] if path is not None
             else map_candidates(model_dir, draft))  # type: ignore[arg-type]
    found = next((c for c in cands if c.is_file()), None)
    if found is None:
        return None
    try:
        lm = LayerMap.from_json(json.loads(found.read_text(encoding="utf-8")))
    except (OSError, json.JSONDecodeError, ValueError) as e:
        raise ValueError(f"layer map {str(found)!r}: {e}") from None
    if num_layers is not None and lm.num_layers != num_layers:
        raise ValueError(f"layer map {str(found)!r} is for {lm.num_layers} layers, the model has {num_layers}")
    if lm.draft != draft:
        raise ValueError(f"layer map {str(found)!r} was made for draft {lm.draft or 'self-speculative'!r}, "
                         f"not {draft or 'self-speculative'!r}")
    if draft_layers is not None and tuple(draft_layers) != lm.draft_layers:
        raise ValueError(f"layer map {str(found)!r} was made for draft layers {list(lm.draft_layers)}, "
                         f"not {list(draft_layers)}")
    return lm


def resolve_layer_map(model: LlamaForCausalLM, model_dir: str | os.PathLike[str] | None,
                      draft_layers: Sequence[int] | None = None, tokenizer: Any | None = None,
                      compute: bool = True, windows: int = 2, tokens: int = 512, steps: int = 8) -> LayerMap:
    """Serve-time lookup: the saved map of ``model_dir`` if it fits this draft; else, with ``compute`` and a
    tokenizer, a map measured on the default text and saved; else the nearest-below fallback."""
    L = model.cfg.num_layers
    draft = validate_draft_layers(default_draft_layers(L) if draft_layers is None else draft_layers, L)
    return _resolve(
        model_dir, compute, tokenizer, windows, tokens,
        load=lambda: load_layer_map(model_dir=model_dir, num_layers=L, draft_layers=draft),
        measure=lambda w, source: compute_layer_map(model, w, draft, steps, source),
        fallback=lambda: nearest_below_map(L, draft))


def resolve_draft_layer_map(model: LlamaForCausalLM, model_dir: str | os.PathLike[str] | None, draft: Any,
                            tokenizer: Any | None = None, compute: bool = True, windows: int = 2, tokens: int = 512,
                            steps: int = 8) -> LayerMap:
    """``resolve_layer_map`` for a separate draft (``draft_model.SeparateDraft``): the map saved next to the
    verifier under the draft's key if it fits; else one measured on the default text and saved; else the
    same-relative-depth fallback."""
    L, m = model.cfg.num_layers, draft.num_layers
    return _resolve(
        model_dir, compute, tokenizer, windows, tokens,
        load=lambda: load_layer_map(model_dir=model_dir, num_layers=L, draft_layers=tuple(range(m)), draft=draft.key),
        measure=lambda w, source: compute_cross_layer_map(model, draft.model, w, draft.key, steps, source),
        fallback=lambda: proportional_map(L, m, draft.key))


def _resolve(model_dir: str | os.PathLike[str] | None, compute: bool, tokenizer: Any | None, windows: int,
             tokens: int, load: Any, measure: Any, fallback: Any) -> LayerMap:
    """The lookup both resolvers share: ``load()`` the saved map (None, or ValueError when stale or foreign),
    else ``measure(windows, source)`` on the default text and save it, else ``fallback()``."""
    if model_dir is not None:
        try:
            lm = load()
        except ValueError:
            lm = None  # stale or foreign: measure afresh below
        if lm is not None:
            return lm
    if compute and tokenizer is not None:
        from raysparse.workload import load_haystack_text

        text, source = load_haystack_text(None)
        lm = measure(text_windows(tokenizer, text, windows, tokens), source)
        if model_dir is not None:
            try:
                save_layer_map(lm, model_dir=model_dir)
            except OSError:
                pass  # serving goes on with the measured map in memory
        return lm
    return fallback()


# ---- command ----------------------------------------------------------------------------------
def specattn_map_main(argv: Sequence[str] | None = None) -> int:
    """Body of ``raysparse specattn-map`` (``map_command.py``); ``argv`` are the arguments after the name."""
    from raysparse.specattn.map_command import main

    return main(argv)
