"""Storage and serve-time lookup of SpecAttn's layer map.

The map is saved as a small JSON file (``specattn_layer_map.json``) in the model directory, or, when that
is not writable, under the raysparse cache directory keyed by the model directory's path; a separate draft's
map sits beside it under the draft's key. ``raysparse specattn-map`` (``map_engine.py``) measures and saves it
on the engine's shard actors; ``resolve_layer_map`` and ``resolve_draft_layer_map`` load it at serve time,
or measure and save it, or fall back to a map of ``layer_map.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from raysparse.model import LlamaForCausalLM
from raysparse.specattn.draft import default_draft_layers, validate_draft_layers
from raysparse.specattn.layer_map import LayerMap, nearest_below_map, proportional_map
from raysparse.specattn.map_measure import compute_cross_layer_map, compute_layer_map, text_windows

MAP_FILE = "specattn_layer_map.json"


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

