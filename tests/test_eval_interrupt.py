"""``raysparse eval`` stopped by Ctrl-C (SIGINT) or SIGTERM part way through a setting: it exits within seconds
with 128 + the signal and one clear line, every process of the Ray instance it started gone, as the JSONL job
does (``orchestration/signals.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import ray_session_in


def _busy_shard(session: str) -> bool:
    """Whether a shard actor of ``session`` runs a call (Ray titles its process with the running method)."""
    from raysparse.orchestration.ray_env import session_processes

    for p in session_processes(session):
        try:
            if " ".join(p.cmdline()).startswith("ray::ShardWorker.__ray_call__"):
                return True
        except Exception:  # noqa: BLE001 - gone since it was listed
            continue
    return False


def _ray_session_of(pid: int) -> str | None:
    """The Ray session directory named on the command line of a descendant of ``pid`` (its Ray daemons)."""
    import psutil

    try:
        return ray_session_in(psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        return None


@pytest.mark.slow  # its own Ray instance and shard actor: ~25 s on two busy cores
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_eval_promptly_with_its_ray(tmp_path: Path, sig: signal.Signals) -> None:
    import psutil

    from raysparse.orchestration.ray_env import session_processes
    from raysparse.serving.tiny import CHAT_TEMPLATE, write_tiny_model
    from raysparse.workload import synthetic_haystack

    model = write_tiny_model(tmp_path / "tiny", layers=8, kv_heads=4, max_positions=4096,
                             chat_template=CHAT_TEMPLATE)
    text = tmp_path / "haystack.txt"
    text.write_text(synthetic_haystack(400, seed=1))
    out = tmp_path / "out"
    # One setting of 60 items whose last 20 (teacher-forced decode over 2000 tokens) take over a second each:
    # an eval that stops only once the setting's items are done cannot meet the deadline below.
    cmd = [sys.executable, "-m", "raysparse.cli", "eval", "--model", str(model), "--text", str(text),
           "--methods", "dense", "--densities", "1", "--tasks", "single_needle", "--samples", "20",
           "--context-tokens", "3000", "--max-new-tokens", "1", "--rows", "0", "--decode-ppl-tokens", "2000",
           "--threads", "1", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # the pipe never fills
    reader.start()
    try:
        session = None
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            session = session or _ray_session_of(proc.pid)
            # the shard is up and working: its setup (a short call) or, a moment later, the items
            if session and any("ready in" in ln for ln in lines) and _busy_shard(session):
                break
            time.sleep(0.1)
        assert proc.poll() is None and session, "".join(lines)[-3000:]
        time.sleep(1.5)
        seen = {p.pid: p for p in session_processes(session)}  # daemons, agents, workers, the shard actor
        assert proc.poll() is None, "".join(lines)[-3000:]
        proc.send_signal(sig)
        t0 = time.monotonic()
        proc.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    reader.join(10)
    output = "".join(lines)
    assert proc.returncode == 128 + sig, output[-3000:]
    said = "raysparse: interrupted" if sig == signal.SIGINT else f"raysparse: signal {int(sig)}: stopped"
    assert said in output and "Traceback" not in output, output[-3000:]
    assert took < 15, f"{took:.1f} s from {sig.name} to exit"
    assert not (out / "eval.json").exists()  # stopped part way, not run to the end
    left = [p for p in seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    left += [p for p in session_processes(session) if p.pid not in seen]
    assert not left, [(p.pid, p.cmdline()) for p in left if p.is_running()]
