"""SpecAttn's layer map measured on the engine's shard actors (the work of ``raysparse specattn-map``).

The engine starts ``--replicas`` groups of ``--tp`` shard actors on Ray (a local instance, or the cluster
at ``--address``), as every command that runs the model does. The driver cuts the text windows; each
window is probed on every shard of one replica (the draft and the verifier attention rows of the shard's
KV heads, ``map_measure.window_similarity``), the shards' similarity sums are added in rank order and the
windows' in window order (``map_measure.map_from_sums``), so the map is the same whatever the number of
replicas, and that of one process up to float rounding under tensor parallelism.

With ``--draft-model PATH`` the map is that of a separate draft model (another depth and head count): every
shard loads the draft whole and probes both models on the window (``map_measure.cross_window_similarity``,
the draft's rows averaged per KV group and mapped onto the shard's verifier KV heads); the map is saved next
to the verifier under the draft's key (``draft_model.draft_key``), where ``raysparse run``, ``serve`` and
``eval`` look it up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from raysparse.orchestration.spread import spread_over_replicas


def _shard_window(worker: Any, window: list[int], draft: tuple[int, ...], steps: int,
                  threads: int | None) -> tuple[torch.Tensor, int]:
    from raysparse.specattn.map_measure import window_similarity

    if threads is not None:
        torch.set_num_threads(threads)
    s, n = window_similarity(worker.executor.model, window, draft, steps)
    return s.cpu(), n


_DRAFTS: dict[tuple[int, str], Any] = {}  # per shard actor process: (worker, draft path) -> the loaded draft


def _shard_cross_window(worker: Any, window: list[int], draft_path: str, steps: int,
                        threads: int | None) -> tuple[torch.Tensor, int]:
    from raysparse.loader import load_model, resolve_source
    from raysparse.specattn.map_measure import cross_window_similarity

    if threads is not None:
        torch.set_num_threads(threads)
    model = worker.executor.model
    key = (id(worker), draft_path)
    if key not in _DRAFTS:  # loaded once per shard, in the verifier's dtype and on its device
        w = model.lm_head.weight
        _DRAFTS[key] = load_model(resolve_source(draft_path), dtype=w.dtype, device=w.device)
    s, n = cross_window_similarity(model, _DRAFTS[key], window, steps)
    return s.cpu(), n


def _shard_forget_draft(worker: Any) -> None:
    for key in [k for k in _DRAFTS if k[0] == id(worker)]:
        del _DRAFTS[key]


def measure_on_engine(engine: Any, windows: Sequence[list[int]], draft: tuple[int, ...] | str, steps: int,
                      threads: int | None = None) -> list[tuple[torch.Tensor, int]]:
    """Every window's similarity sums over the whole model, the windows spread over the replicas. ``draft``:
    the self-speculative draft's layers, or a separate draft model's path."""
    groups = [r.group for r in engine.runners]
    parts: list[tuple[torch.Tensor, int] | None] = [None] * len(windows)
    fn = _shard_cross_window if isinstance(draft, str) else _shard_window

    def submit(group: Any, i: int) -> list[Any]:
        return group.submit("__ray_call__", fn, list(windows[i]), draft, steps, threads)

    def done(i: int, shards: list[tuple[torch.Tensor, int]]) -> bool:
        total, terms = shards[0][0].clone(), shards[0][1]
        for s, n in shards[1:]:  # rank order: each shard holds its own KV heads
            total, terms = total + s, terms + n
        parts[i] = (total, terms)
        return True

    # One driver thread waits on every replica's calls (``orchestration.spread``), so Ctrl-C stops the map at once.
    spread_over_replicas(groups, len(windows), submit, done)
    if isinstance(draft, str):
        for g in groups:
            g.call("__ray_call__", _shard_forget_draft)
    return parts  # type: ignore[return-value]
