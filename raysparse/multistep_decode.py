"""A shard's decode steps, one or several in a step (``StepPlan.steps``), and the draws shared between them.

Between steps every rank needs rank 0's draw as its next input: it is shared with one all-reduce (rank 0
contributes the tokens, the others zeros). Greedy steps replayed from captured graphs chain on the device
instead, each shard drawing its own tokens, and one small all-reduce proves the shards drew the same.

``MultiStepDecode`` is a part of ``ShardExecutor`` (its base), kept here so the executor's own module stays
the step's outline; it uses the executor's forward, sampler and group all-reduce and names no method.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from raysparse.attention import AttentionBackend
from raysparse.decode_graphs import DecodeGraphs
from raysparse.kv_cache import KVCache
from raysparse.sampling import SamplingParams
from raysparse.step_plan import StepPlan


class MultiStepDecode:
    """``ShardExecutor``'s decode steps: one, several with rank 0's draws shared, or greedy chained on the
    device with the shards' agreement checked."""

    # the executor's, set by ``ShardExecutor``: its rank, group, cache, per-sequence sampling and the
    # group's untimed all-reduce, its forward and rank-0 sampling, and its graph runner for a backend
    rank: int
    world_size: int
    cache: KVCache
    _params: dict[int, SamplingParams]
    _share_reduce: Callable[[torch.Tensor], torch.Tensor] | None
    _forward: Callable[[StepPlan, AttentionBackend, list[list[int]]], torch.Tensor]
    _sample: Callable[[StepPlan, torch.Tensor], list[int | None] | None]
    _graphs_for: Callable[[AttentionBackend], DecodeGraphs | None]

    def _decode(self, plan: StepPlan, backend: AttentionBackend) -> list[int | None] | list[list[int]] | None:
        """One or more decode steps. Between steps every rank needs rank 0's draw as its next input: it is
        shared with one all-reduce (rank 0 contributes the tokens, the others zeros)."""
        if plan.steps == 1:
            return self._sample(plan, self._forward(plan, backend, plan.tokens))
        graphs = self._graphs_for(backend)
        if graphs is not None and all(self._params[s].plain_greedy for s in plan.seq_ids):
            # greedy: the steps chain on the device, no round trip or token exchange between them
            chained = graphs.decode_greedy(plan.key, backend, plan.seq_ids, [t[-1] for t in plan.tokens],
                                                plan.steps)
            if self.world_size > 1:
                self._check_agreement(chained)
            return chained if self.rank == 0 else None
        tokens = [[t[-1]] for t in plan.tokens]
        out: list[list[int]] = [[] for _ in plan.seq_ids]
        for step in range(plan.steps):
            drawn = self._sample(plan, self._forward(plan, backend, tokens))
            if step + 1 < plan.steps and self.world_size > 1:
                drawn = self._share(drawn, len(plan.seq_ids))
            if drawn is not None:
                tokens = [[int(t)] for t in drawn]  # type: ignore[arg-type]
                for row, t in zip(out, drawn, strict=True):
                    row.append(int(t))  # type: ignore[arg-type]
        return out if self.rank == 0 else None

    def _check_agreement(self, tokens: list[list[int]]) -> None:
        """Each shard drew its own greedy tokens; one small all-reduce proves they are the same everywhere
        (sum of h and of h^2 equal to world * h and world * h^2 only if every shard's h is equal)."""
        h = float(hash(tuple(map(tuple, tokens))) % 1_000_003)
        t = torch.tensor([h, h * h], dtype=torch.float64, device=self.cache.device)
        s = self._share_reduce(t).tolist()  # type: ignore[misc]
        if s != [self.world_size * h, self.world_size * h * h]:
            raise RuntimeError("tensor-parallel shards drew different greedy tokens")

    def _share(self, drawn: list[int | None] | None, n: int) -> list[int | None]:
        if self._share_reduce is None:
            raise RuntimeError("multi-step decode over several shards needs the group's all-reduce")
        t = torch.tensor(drawn if drawn is not None else [0] * n, dtype=torch.long, device=self.cache.device)
        return self._share_reduce(t).tolist()
