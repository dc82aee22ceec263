"""Layer mapping f: verifier layer -> draft layer, by monotone DTW over attention KL similarities.

This module holds the map itself (``LayerMap`` and its JSON form), the fallbacks used when none was measured
(``nearest_below_map``, ``proportional_map``): data a command, the draft actor and the verifier read. The
map is measured in ``map_measure.py`` (both models' attention rows on real text, their -KL similarities from ``dtw.py``,
aligned by ``dtw.monotone_dtw``), saved, loaded and resolved at serve time in ``map_store.py``, and
``raysparse specattn-map`` is ``raysparse/cli/specattn_map.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from raysparse.specattn.draft import validate_draft_layers

FORMAT = "raysparse-specattn-layer-map"
VERSION = 1


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
