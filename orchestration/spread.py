"""Work items spread over an engine's replicas from one driver thread (``raysparse eval``, ``raysparse
specattn-map``): the next free replica takes the next item, and every wait is one ``ray.wait`` over all the shard
calls in flight, on the calling thread.

With no helper threads, Ctrl-C (KeyboardInterrupt) lands in that wait and unwinds at once: nothing is left that
still takes items or that an exit would have to join, and the engine's shutdown on the way out kills the shards,
which ends the items in flight. A thread per replica blocked in its own wait kept taking items until the work
was done (25-35 s after Ctrl-C in an eval). A lost shard (``ShardLostError``) ends the work the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _ItemCall:
    """One item running on every shard of one replica: its shards' refs and the results back so far."""

    group: Any
    index: int
    refs: list[Any]
    results: dict[Any, Any] = field(default_factory=dict)


def spread_over_replicas(groups: Sequence[Any], count: int, submit: Callable[[Any, int], list[Any]],
                         done: Callable[[int, list[Any]], bool]) -> None:
    """Runs items 0 .. count - 1 over ``groups`` (``ReplicaGroup``s). ``submit(group, i)`` starts item i on
    every shard of the group and returns the refs in rank order (``ReplicaGroup.submit``); ``done(i, results)``
    gets the item's results in rank order, as each item completes, and returns whether to go on starting items
    (False: the items not started yet are dropped, the ones in flight still finish)."""
    import ray

    nxt, going = 0, True
    calls: dict[Any, _ItemCall] = {}  # the ref of each shard call in flight -> its item

    def start(group: Any) -> None:
        nonlocal nxt
        if going and nxt < count:
            call = _ItemCall(group, nxt, submit(group, nxt))
            calls.update(dict.fromkeys(call.refs, call))
            nxt += 1

    for g in groups:
        start(g)
    while calls:
        (ref,), _ = ray.wait(list(calls), num_returns=1)
        call = calls.pop(ref)
        call.results[ref] = call.group.result(call.refs, ref)
        if len(call.results) == len(call.refs):
            going = done(call.index, [call.results[r] for r in call.refs]) and going
            start(call.group)
