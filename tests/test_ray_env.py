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
