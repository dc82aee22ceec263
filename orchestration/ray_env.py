"""Joining or starting Ray with the environment every raysparse process needs."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

LOCAL_RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",  # the in-process instance listens on 127.0.0.1 only
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}
# Every worker process: no hub access, quiet tokenizers and progress bars, and NVLink multicast off (it can
# take a shared multi-GPU host's GPUs out of service).
WORKER_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1",
              "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# The project's two environment variables: the kernel path override (``kernels.dispatch``) and the weights
# cache (``loader``). Every other switch travels in ``EngineConfig.runtime``.
FORWARDED = ("RAYSPARSE_KERNELS", "RAYSPARSE_CACHE")


def start_ray(address: str | None, num_cpus: int | None = None, env: dict[str, str] | None = None) -> bool:
    """Connects to Ray; returns True when this call started a local instance (so the caller stops it).
    ``env``: more environment for this job's workers (on top of ``WORKER_ENV``)."""
    import ray

    if ray.is_initialized():
        return False
    for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(k, WORKER_ENV[k])
    # they reach the workers on any cluster, not only a local one
    own = {k: os.environ[k] for k in FORWARDED if k in os.environ}
    runtime_env = {"env_vars": {**WORKER_ENV, **own, **(env or {})}}
    kept = signal.getsignal(signal.SIGTERM)
    try:
        if address is None:
            for k, v in LOCAL_RAY_ENV.items():
                os.environ.setdefault(k, v)
            # address="local": always an instance of our own, never whatever cluster already runs on the host (a
            # `ray start` or RAY_ADDRESS, which plain ray.init() would join, or hang on if it is stale).
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING,
                     runtime_env=runtime_env, log_to_driver=True)
            _start_reaper()
            return True
        ray.init(address=address, logging_level=logging.WARNING, runtime_env=runtime_env)
        return False
    finally:
        _restore_sigterm(kept)


def _restore_sigterm(handler: Any) -> None:
    """``ray.init`` puts in a SIGTERM handler of its own (``sys.exit`` from whatever runs; an eval stopped that
    way exited -6 and left the instance's dashboard and runtime-env agents running): the handler in force before
    it (``orchestration.signals.StopOnSignals``, or the default) is put back. Only the main thread can."""
    if handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


def local_instance() -> bool:
    """Whether this process started the Ray instance it is connected to (``start_ray`` without an address,
    called by this engine or by the server in front of it): that instance's cores are this process's to share
    out among its shards."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    return ray.is_initialized() and node is not None and bool(node.head)


def stop_ray(grace_s: float = 5.0) -> list[int]:
    """Stops the local Ray instance this process started, every process of it included, and returns the pids
    that were still alive after ``ray.shutdown()`` and had to be ended here.

    ``ray.shutdown`` stops the head's daemons, but the processes those start (the dashboard and runtime-env
    agents, idle workers) only notice later, if at all. Every process of the instance names its session
    directory on its command line or descends from one that does: those are ended too (SIGTERM, then SIGKILL
    after ``grace_s``). Nothing outside this instance is touched: another Ray on the host has another session."""
    import ray

    _stop_reaper()  # this process ends the instance itself: its reaper is not needed (and not one of its own)
    node = getattr(ray._private.worker, "_global_node", None)
    session = node.get_session_dir_path() if node is not None and node.head else None
    before = session_processes(session) if session else []
    ray.shutdown()
    if not session:
        return []
    seen = {p.pid for p in before}
    left = [p for p in before + [q for q in session_processes(session) if q.pid not in seen] if _running(p)]
    end_processes(left, grace_s)
    return [p.pid for p in left]


def end_processes(procs: list, grace_s: float) -> None:
    """SIGTERM to each of ``procs`` (``psutil.Process``), then SIGKILL to those alive after ``grace_s``."""
    import psutil

    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


# The local instance's reaper: a small process of its own (``ray_reaper``) that ends every process of the
# instance's session when this process dies without ``stop_ray`` (SIGKILL, an out-of-memory kill). Ray's daemons
# follow their driver out, but the agents they start (runtime-env, dashboard) and idle workers do not.
_reaper: Any = None


def _start_reaper() -> None:
    import subprocess
    import sys

    import ray

    global _reaper
    _stop_reaper()  # an earlier instance's, shut down without ``stop_ray``
    node = getattr(ray._private.worker, "_global_node", None)
    if node is None or not node.head:
        return
    # a session of its own, so a terminal's Ctrl-C (the process group's SIGINT) does not end it before the job
    _reaper = subprocess.Popen([sys.executable, "-m", "raysparse.orchestration.ray_reaper", str(os.getpid()),
                                node.get_session_dir_path()], stdin=subprocess.DEVNULL, start_new_session=True)


def _stop_reaper() -> None:
    global _reaper
    if _reaper is not None and _reaper.poll() is None:
        _reaper.terminate()
        try:
            _reaper.wait(timeout=5)
        except Exception:  # noqa: BLE001 - it ends at its next look at its parent anyway
            pass
    _reaper = None


def session_processes(session: str) -> list:
    """The processes (``psutil.Process``) whose command line names the Ray session directory ``session``, and
    their descendants; never this process."""
    import psutil

    me = os.getpid()
    roots = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.info["pid"] != me and any(session in a for a in p.info["cmdline"] or ()):
                roots.append(p)
        except psutil.Error:
            continue
    found = {p.pid: p for p in roots}
    for p in roots:
        try:
            found.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.Error:
            continue
    found.pop(me, None)
    return [found[pid] for pid in sorted(found)]


def _running(p) -> bool:  # noqa: ANN001 - a psutil.Process
    import psutil

    try:  # is_running() also tells a reused pid apart (by its start time)
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
