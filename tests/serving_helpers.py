"""Shared by the tests of what serves the tiny model (the gRPC and OpenAI APIs, lm-eval, the jobs, Ray Data): the
plain transformers oracle, the wait for a server's KV cache to drain, and `raysparse serve` in a real process."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from helpers import free_port

from raysparse.serving.client import RaySparseClient
from raysparse.serving.proto import raysparse_pb2 as pb


@functools.cache
def reference_model(model_dir: str | Path) -> Any:
    """The tiny model as transformers loads it (a ``LlamaForCausalLM``), once per directory."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_greedy(model_dir: str | Path, prompt: list[int], n: int) -> list[int]:
    """Plain transformers forward passes, argmax, no cache: the oracle of ``n`` greedy tokens after ``prompt``."""
    model = reference_model(model_dir)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def reference_logprobs(model_dir: str | Path, ids: list[int]) -> torch.Tensor:
    """The tiny model's log-softmax at every position of ``ids`` through transformers' own forward: [T, V]."""
    with torch.no_grad():
        return torch.log_softmax(reference_model(model_dir)(torch.tensor([ids])).logits[0].float(), -1)


def wait_kv_free(client: RaySparseClient, timeout: float = 15.0) -> pb.ServerInfo:
    """The server's info once it holds no KV and runs or queues no request; fails after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = client.server_info()
        if info.kv_used_tokens == 0 and info.running == 0 and info.waiting == 0:
            return info
        time.sleep(0.05)
    raise AssertionError(f"KV not freed: {client.server_info()}")


@dataclass(frozen=True)
class ServeProcess:
    proc: subprocess.Popen
    grpc: RaySparseClient  # serving once the process is yielded
    port: int
    metrics_port: int
    http_port: int


@contextmanager
def serve_process(model: str | Path, *args: str) -> Iterator[ServeProcess]:
    """``raysparse serve`` of ``model`` (gRPC, metrics and OpenAI HTTP ports free on 127.0.0.1, two CPUs, no
    draft, ``args`` added) in a real process, yielded once it serves; SIGTERM at the end, then a kill if it
    has not exited within 60 s."""
    port, mport, hport = free_port(), free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "raysparse.cli", "serve", "--model", str(model), "--port", str(port),
                             "--metrics-port", str(mport), "--http-port", str(hport), "--num-cpus", "2",
                             "--cpus-per-shard", "0.5", "--no-draft", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
    grpc_client = RaySparseClient(f"127.0.0.1:{port}")
    try:
        grpc_client.wait_serving(120)
        yield ServeProcess(proc, grpc_client, port, mport, hport)
    finally:
        grpc_client.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
