"""``orchestration.parallel.run_in_parallel``: results in order, the first error re-raised after all end, and a
signal in the waiting thread leaving at once while the calls still block (the engine's start)."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from raysparse.orchestration.parallel import run_in_parallel
from raysparse.orchestration.signals import Signalled, StopOnSignals


def test_results_in_call_order() -> None:
    def call(i: int):
        def f() -> int:
            time.sleep(0.05 * (3 - i))  # finish in reverse order
            return i * i
        return f

    assert run_in_parallel([call(i) for i in range(4)]) == [0, 1, 4, 9]
    assert run_in_parallel([]) == []


def test_first_error_in_call_order_after_all_end() -> None:
    ended = []

    def slow() -> None:
        time.sleep(0.3)
        ended.append("slow")

    def bad(msg: str):
        def f() -> None:
            raise ValueError(msg)
        return f

    with pytest.raises(ValueError, match="first"):
        run_in_parallel([slow, bad("first"), bad("second")])
    assert ended == ["slow"]  # the waiting thread joined the slow call before it raised


def test_signal_leaves_while_calls_block() -> None:
    release = threading.Event()
    stopper = StopOnSignals()
    try:
        threading.Timer(0.3, signal.raise_signal, (signal.SIGTERM,)).start()
        t0 = time.monotonic()
        with pytest.raises(Signalled) as info:
            run_in_parallel([lambda: release.wait(30), lambda: release.wait(30)])
        waited = time.monotonic() - t0
    finally:
        stopper.restore()
        release.set()
    assert info.value.signum == signal.SIGTERM
    assert waited < 5, f"the signal waited {waited:.1f} s for the blocked calls"
    blocked = [t for t in threading.enumerate() if t.name.startswith("raysparse-call")]
    assert all(t.daemon for t in blocked)  # they would not hold the process's exit
