"""SIGTERM, SIGINT and SIGHUP for the commands that start an engine (``raysparse run``, ``eval``,
``specattn-map``, the JSONL job): each unwinds the main thread as ``Signalled``, so the engine and the Ray
instance the command started are stopped on the way out, and the command exits with 128 + the signal.

``ray.init`` installs a SIGTERM handler of its own, under which an eval stopped by SIGTERM (``ray job stop``
sends one) exited -6 and left the Ray instance's dashboard and runtime-env agents running.
``ray_env.start_ray`` puts the handler in force before it back, so these stay in place. While ``cleaning`` is set,
a signal is only noted (``signum``), so a second one does not cut the clean-up short.
"""

from __future__ import annotations

import signal
from typing import Any


class Signalled(BaseException):  # noqa: N818 - not an error: the command was asked to stop
    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum

    def message(self, prog: str) -> str:
        return f"{prog}: interrupted" if self.signum == signal.SIGINT else f"{prog}: signal {self.signum}: stopped"


class StopOnSignals:
    """Raises ``Signalled`` in the main thread on SIGTERM, SIGINT or SIGHUP, from construction until
    ``restore``."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self) -> None:
        self.cleaning = False
        self.signum = 0
        self.previous = {sig: signal.getsignal(sig) for sig in self.SIGNALS}
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signum or self.cleaning:
            self.signum = self.signum or signum
            return
        self.signum = signum
        raise Signalled(signum)
