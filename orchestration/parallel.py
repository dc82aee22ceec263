"""Blocking calls run side by side on daemon threads, with the main thread left free to take signals.

The engine starts its replicas' shard groups together (each loads weights for minutes at the largest sizes).
A ``ThreadPoolExecutor`` made a stop during that load wait for it: a signal raised in the waiting main thread
(``signals.Signalled``) left the ``with`` block, whose exit joins the pool's workers, and the interpreter's
exit joins them again. Here the main thread waits in short joins, so a signal's exception leaves at once; the
caller then stops what the calls wait on (the engine kills its shard actors), and threads still blocked are
daemons that do not hold the process's exit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

_POLL_S = 0.2  # the longest a signal waits for the main thread to notice it


def run_in_parallel(calls: Sequence[Callable[[], Any]], name: str = "raysparse-call") -> list[Any]:
    """Runs every call on its own daemon thread and returns their results in order. The first call to raise
    (in call order) has its exception re-raised once all have ended; an exception in the waiting thread (a
    signal's) leaves at once, with the calls still running."""
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException | None] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread, which re-raises it
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,), name=f"{name}-{i}", daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(_POLL_S)
    for e in errors:
        if e is not None:
            raise e
    return results
