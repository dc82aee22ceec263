"""The local Ray instance's reaper: ends every process of the instance's session once the process that started
it has died, however it died.

``ray_env.start_ray`` runs it beside a local instance: ``python -m raysparse.orchestration.ray_reaper PID
SESSION_DIR``. ``stop_ray`` ends the instance itself and this process first (SIGTERM: it exits at once). A
process killed without cleanup (SIGKILL, the out-of-memory killer) takes Ray's daemons with it, but not the
agents they started (runtime-env, dashboard) nor idle workers; this process sees its parent go (it is
re-parented: ``getppid`` changes, which a reused pid cannot fake) within ``POLL_S`` and ends them as
``stop_ray`` would. Those are found by the session directory on their command lines and their descendants
(``session_processes``), but the agents rename themselves (``ray::RuntimeEnvAgent``) and, once the raylet
is gone, descend from nothing of the session: so the processes of the session are looked up while the
parent lives, every ``SCAN_S``, and all seen (still the same processes: psutil checks their start times) are
ended with those found at the end. It imports nothing of Ray or torch, so it costs a few megabytes.
"""

from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 0.2
SCAN_S = 5.0  # between two looks for the session's processes (a scan of every process on the host)
GRACE_S = 3.0  # SIGTERM, then SIGKILL for what is still alive after this


def reap(parent: int, session: str, poll_s: float = POLL_S, scan_s: float = SCAN_S) -> int:
    """Waits for ``parent`` to die, then ends the processes of ``session``; returns how many it ended."""
    import psutil

    from raysparse.orchestration.ray_env import end_processes, session_processes

    seen: dict[int, psutil.Process] = {}
    next_scan = 0.0
    while os.getppid() == parent:
        if time.monotonic() >= next_scan:
            seen.update({p.pid: p for p in session_processes(session)})
            next_scan = time.monotonic() + scan_s
        time.sleep(poll_s)
    found = {p.pid: p for p in session_processes(session)}
    left = [p for p in {**seen, **found}.values() if p.pid != os.getpid() and p.is_running()]
    end_processes(left, GRACE_S)
    return len(left)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[0].isdigit():
        print("usage: python -m raysparse.orchestration.ray_reaper PARENT_PID SESSION_DIR", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop_ray's: the instance is being stopped already
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    reap(int(args[0]), args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
