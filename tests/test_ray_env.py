"""Starting Ray without ``--address``: an instance of the process's own, never a cluster already on the host."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from helpers import free_port

CHILD = """
import ray
from raysparse.orchestration.ray_env import start_ray
assert start_ray(None)
print("GCS", ray.get_runtime_context().gcs_address, flush=True)
ray.shutdown()
"""


@pytest.mark.slow
def test_local_start_never_joins_a_running_cluster():
    """A `ray start --head` cluster runs on the host and RAY_ADDRESS points at it (what plain ``ray.init()``
    joins): ``start_ray(None)`` still starts its own instance. The test stops only the cluster it started:
    ``ray start --block`` in a session of its own, whose process group is signalled at the end."""
    if shutil.which("ray") is None:
        pytest.skip("the ray command is not installed")
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    head = subprocess.Popen(["ray", "start", "--head", "--block", f"--port={port}", "--num-cpus=1",
                             "--include-dashboard=false", "--disable-usage-stats"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:  # the head is up once its GCS port answers
            probe = subprocess.run(["ray", "status", f"--address=127.0.0.1:{port}"], env=env, capture_output=True,
                                   timeout=60)
            if probe.returncode == 0:
                break
            assert head.poll() is None and time.monotonic() < deadline, "the test's own Ray head did not start"
            time.sleep(2)
        out = subprocess.run([sys.executable, "-c", CHILD], env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}"},
                             capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stderr[-2000:]
        gcs = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("GCS ")]
        assert gcs and not gcs[0].endswith(f":{port}"), f"joined the host's cluster: {gcs}"
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)


PARENT = """
import os, subprocess, sys, time
import psutil
session = sys.argv[1]
# a process naming the session, as Ray's daemons do, and one whose child names nothing, as an agent (renamed
# ``ray::RuntimeEnvAgent``) is the raylet's child until the raylet dies
named = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", session])
renamed = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
                            "time.sleep(600)", session])
while not psutil.Process(renamed.pid).children():
    time.sleep(0.05)
reaper = subprocess.Popen([sys.executable, "-m", "raysparse.orchestration.ray_reaper", str(os.getpid()), session],
                          start_new_session=True)
print(named.pid, renamed.pid, reaper.pid, flush=True)
time.sleep(600)
"""


def test_the_reaper_ends_the_session_when_its_parent_is_sigkilled(tmp_path):
    """``start_ray``'s reaper: once the process that started the instance dies without cleanup, every process
    of its session is ended, those that no longer name the session included (seen while the parent lived)."""
    import psutil

    session = str(tmp_path / "session_2026-01-01_00-00-00_000000_1")
    parent = subprocess.Popen([sys.executable, "-c", PARENT, session], stdout=subprocess.PIPE, text=True)
    procs: list[psutil.Process] = []
    try:
        named, renamed, reaper = (psutil.Process(int(x)) for x in parent.stdout.readline().split())
        grandchild = renamed.children()[0]  # names no session: found as a descendant of one that does
        procs = [named, renamed, grandchild, reaper]
        time.sleep(1.0)  # the reaper's first look at the session
        os.kill(renamed.pid, signal.SIGKILL)  # its child, now re-parented, descends from nothing of the session
        parent.kill()
        parent.wait(30)
        killed = time.monotonic()
        while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs) and \
                time.monotonic() - killed < 10:
            time.sleep(0.1)
        left = [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not left, left
    finally:
        for p in procs:
            try:
                p.kill()
            except psutil.Error:
                pass
        if parent.poll() is None:
            parent.kill()
