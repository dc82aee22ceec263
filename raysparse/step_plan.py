"""What the engine sends a group's shards each step (``StepPlan``) and the method keys it names: a method
with its parameters, canonical JSON, so equal settings share one backend on every shard."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


def method_key(method: str, params: tuple[tuple[str, Any], ...] | dict[str, Any] = ()) -> str:
    """The canonical name of a method with its parameters (backends are shared per key)."""
    items = sorted(dict(params).items())
    return json.dumps([method, items], default=list)


def parse_key(key: str) -> tuple[str, dict[str, Any]]:
    method, items = json.loads(key)
    return method, {k: tuple(v) if isinstance(v, list) else v for k, v in items}


@dataclass
class StepPlan:
    """One engine step for one group. ``tokens[i]`` are the new tokens of ``seq_ids[i]`` (the prompt in a
    prefill, the last sampled token in a decode); ``admit`` rows are (seq id, reserved tokens, sampling
    params as a dict, the sequence's physical pages, prompt tokens already in them from the prefix cache),
    applied after ``free`` and before the forward. A sequence's ``tokens`` in its first prefill step start
    after its cached prefix."""

    key: str
    prefill: bool
    seq_ids: list[int] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    admit: list[tuple[Any, ...]] = field(default_factory=list)
    free: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)  # per sequence; empty = all (a non-final prefill chunk: no)
    steps: int = 1  # decode: consecutive steps in one call, each feeding back the tokens it sampled
    # prefill: its first ``decode_rows`` sequences are running ones decoding their last sampled token in the step,
    # a one-token row each (a mixed step, for a method whose capabilities allow ``mixed_steps``)
    decode_rows: int = 0
