"""The engine's frozen, validated configuration (every command that runs the model builds one)."""

from __future__ import annotations

from dataclasses import dataclass

from raysparse.config import parse_dtype
from raysparse.kv_tiers import KVOffloadConfig
from raysparse.orchestration.prefix_cache import PrefixCacheConfig
from raysparse.runtime_config import RuntimeConfig

# Prompt tokens one prefill step may carry when ``max_prefill_tokens`` is left unset. Decode steps of other
# requests run between two chunks, so a chunk's time is the longest a stream waits while a prompt prefills; but
# every chunk pays the layers' fixed work and re-reads the prompt's earlier K/V, so smaller chunks make the
# prompt, and the streams waiting behind it, slower in all. CPU: 512 tokens at 4K of context is about half a
# second on two cores. GPU: whole prompts up to 64K tokens.
PREFILL_CHUNK_CPU = 512
PREFILL_CHUNK_GPU = 65536
# While no request decodes there is no stall to bound, so a CPU prompt takes this many tokens a step (the fewer
# chunks, the less each chunk's fixed work and each sparse method's per-chunk selection work cost). Not a
# whole prompt: a step is not interrupted, so a request cancelled or past its deadline mid-prompt holds the
# engine until its step ends.
IDLE_PREFILL_CPU = 2048
# Decode steps one call to the shards runs while no prompt waits (``decode_steps`` unset). A CPU step is tens of
# milliseconds, so the call's Ray round trip and the scheduler's turn (a few milliseconds) are paid once for four
# steps; a prompt that arrives waits at most that call. GPU steps replay as Ray compiled graphs, one per call.
DECODE_STEPS_CPU = 4
DECODE_STEPS_GPU = 1


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # local HF directory or GGUF file; None: the default model
    dtype: str = "float32"
    tp: int = 1  # tensor-parallel shards per replica
    replicas: int = 1  # data-parallel replicas, spread over the cluster's nodes
    address: str | None = None  # an existing Ray cluster; None: a local instance started in-process
    device: str = "auto"  # "auto": GPUs when the cluster has them, else CPU processes
    kv_cache_tokens: int = 16384  # per replica
    page_size: int = 64
    max_batch: int = 64
    max_prefill_tokens: int | None = None  # prompt tokens per prefill step; None: PREFILL_CHUNK_CPU or _GPU
    max_waiting: int = 4096
    cpus_per_shard: float = 1.0
    num_cpus: int | None = None  # CPUs of the local Ray instance (None: all)
    random_weights: bool = False  # config only, seeded random weights (speed runs of big models)
    seed: int = 0
    load_timeout_s: float = 900.0
    name: str = ""  # prefix of actor and placement group names; "" = raysparse-<random>
    draft: bool = True  # start the SpecAttn draft actor (one per replica)
    draft_model: str | None = None  # SpecAttn's separate draft checkpoint (None: the self-speculative draft)
    cuda_graphs: bool = True  # GPUs: replay decode steps from captured CUDA graphs (methods that allow it)
    decode_steps: int | None = None  # decode steps per call to the shards while no prompt waits; None: the device's
    runtime: RuntimeConfig = RuntimeConfig()  # which kernels and collectives the shards run (validated there)
    # "own": each replica makes its placement group; "current": the one replica's shards take bundles 1..tp of
    # the placement group this process runs in (a Ray Serve replica's, whose bundle 0 is the replica itself)
    placement: str = "own"
    liveness_s: float = 1.0  # an idle replica pings its actors this often, to find a dead one before a request
    prefix_cache: PrefixCacheConfig = PrefixCacheConfig()  # prompts share cached full pages of equal prefixes
    # ``--kv-offload``: ``kv_cache_tokens`` is then the host tier (every sequence's whole K/V) and this the device pool
    # of hot pages per layer each shard decodes through (raysparse/kv_tiers.py); None: all K/V in device memory
    kv_offload: KVOffloadConfig | None = None

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        for name in ("tp", "replicas", "kv_cache_tokens", "page_size", "max_batch", "max_prefill_tokens",
                     "max_waiting", "decode_steps"):
            v = getattr(self, name)
            if v is None and name in ("max_prefill_tokens", "decode_steps"):
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if not self.cpus_per_shard > 0:
            raise ValueError(f"cpus_per_shard must be > 0, got {self.cpus_per_shard}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ValueError(f"num_cpus must be >= 1, got {self.num_cpus}")
        if not self.liveness_s > 0:
            raise ValueError(f"liveness_s must be > 0, got {self.liveness_s}")
        if self.load_timeout_s <= 0:
            raise ValueError("load_timeout_s must be > 0")
        if self.draft_model is not None and not self.draft:
            raise ValueError("a draft model needs the draft actor (draft=True)")
        if self.placement not in ("own", "current"):
            raise ValueError(f"placement must be own or current, got {self.placement!r}")
        if self.placement == "current" and self.replicas != 1:
            raise ValueError("placement 'current' serves one replica (the placement group's)")
        if not isinstance(self.prefix_cache, PrefixCacheConfig):
            raise ValueError(f"prefix_cache must be a PrefixCacheConfig, got {type(self.prefix_cache).__name__}")
        if not isinstance(self.runtime, RuntimeConfig):
            raise ValueError(f"runtime must be a RuntimeConfig, got {type(self.runtime).__name__}")
        if self.kv_offload is not None:
            if not isinstance(self.kv_offload, KVOffloadConfig):
                raise ValueError(f"kv_offload must be a KVOffloadConfig, got {type(self.kv_offload).__name__}")
            self.kv_offload.device_pages(self.page_size)  # raises its one-line error for a pool too small
            # Every device: on GPUs the host tier is pinned host memory. The shards then decode eagerly whatever
            # ``cuda_graphs`` says (the copies follow each layer's selection on the host); a method the tier cannot
            # serve is refused by the shard at its first step, with one line (docs/kv_offload.md).

    def device_pages(self) -> int | None:
        """The device pool's pages per layer under ``kv_offload`` (the scheduler's ``device_pages``); None without."""
        return None if self.kv_offload is None else self.kv_offload.device_pages(self.page_size)

    def prefill_chunk(self, use_gpu: bool) -> int:
        """The prefill budget in force: ``max_prefill_tokens``, or the default for the shards' device."""
        if self.max_prefill_tokens is not None:
            return self.max_prefill_tokens
        return PREFILL_CHUNK_GPU if use_gpu else PREFILL_CHUNK_CPU

    def decode_steps_for(self, use_gpu: bool) -> int:
        """Decode steps per call to the shards while no prompt waits: ``decode_steps``, or the default for the
        shards' device."""
        if self.decode_steps is not None:
            return self.decode_steps
        return DECODE_STEPS_GPU if use_gpu else DECODE_STEPS_CPU

    def idle_prefill(self, use_gpu: bool) -> int | None:
        """The head prompt's budget while nothing decodes (None: ``prefill_chunk``'s). A ``max_prefill_tokens``
        the user set holds at every step."""
        if self.max_prefill_tokens is not None or use_gpu:
            return None
        return IDLE_PREFILL_CPU
