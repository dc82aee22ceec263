"""Joining or starting Ray with the environment every raysparse process needs."""

from __future__ import annotations

import logging
import os

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
    if address is None:
        for k, v in LOCAL_RAY_ENV.items():
            os.environ.setdefault(k, v)
        # address="local": always an instance of our own, never whatever cluster already runs on the host (a
        # `ray start` or RAY_ADDRESS, which plain ray.init() would join, or hang on if it is stale).
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING,
                 runtime_env=runtime_env, log_to_driver=True)
        return True
    ray.init(address=address, logging_level=logging.WARNING, runtime_env=runtime_env)
    return False
