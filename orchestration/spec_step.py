"""SpecAttn rounds in the engine (draft actor + verification on the shards)."""

from __future__ import annotations

from typing import Any


def attach_spec_steps(engine: Any, spec: Any) -> None:
    return None
