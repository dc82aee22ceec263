"""The model worker actor: one device's model, KV cache and attention backends.

It streams everything back as plain dict events (``{"type": ...}``) through Ray streaming generators,
so the caller sees load progress, prefill progress and each token as it comes. Generation runs in a
thread that feeds a queue because the model reports prefill progress from inside its forward pass.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import torch

from raysparse.config import parse_dtype
from raysparse.generate import FinishEvent, GenerationRequest, Generator, TokenEvent
from raysparse.kv_cache import KVCache
from raysparse.loader import load_hf_config, load_model, load_tokenizer, materialize, resolve_source
from raysparse.methods.registry import create_backend
from raysparse.sampling import SamplingParams

Event = dict[str, Any]


class ModelWorker:
    def __init__(self, model_path: str | None = None, dtype: str = "float32", kv_cache_tokens: int = 16384,
                 page_size: int = 64, num_threads: int | None = None, device: str = "cpu") -> None:
        self.model_path, self.dtype, self.device = model_path, parse_dtype(dtype), device
        self.kv_cache_tokens, self.page_size = kv_cache_tokens, page_size
        # Ray pins OMP threads to the actor's CPU share; prefill wants every core it was given.
        torch.set_num_threads(num_threads or os.cpu_count() or 1)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # our own progress events replace transformers' bars
        self.model = self.tokenizer = self.cache = None
        self.source_name = ""

    def load(self) -> Iterator[Event]:
        t0 = time.perf_counter()
        src = resolve_source(self.model_path)
        self.source_name = src.name
        if src.gguf_file is not None:
            yield {"type": "progress", "stage": "converting GGUF to a cached HF copy (first run only)"}
            src = materialize(src)
        self.model_dir = src.directory
        yield {"type": "progress", "stage": "reading config"}
        hf_config = load_hf_config(src)
        yield {"type": "progress", "stage": "loading tokenizer"}
        self.tokenizer = load_tokenizer(src)
        yield {"type": "progress", "stage": "loading weights"}
        self.model = load_model(src, dtype=self.dtype, device=self.device, hf_config=hf_config)
        cfg = self.model.cfg
        pages = -(-self.kv_cache_tokens // self.page_size)
        self.cache = KVCache(cfg, pages, self.page_size, self.dtype, self.device, self.model.num_kv_heads)
        yield {"type": "ready", "seconds": time.perf_counter() - t0, **self.info()}

    def info(self) -> dict[str, Any]:
        cfg = self.model.cfg
        return {"model": self.source_name, "layers": cfg.num_layers, "heads": cfg.num_heads,
                "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                "max_positions": cfg.max_position_embeddings, "dtype": str(self.dtype).replace("torch.", ""),
                "kv_bytes_per_token": KVCache.bytes_per_token(cfg, self.dtype, self.model.num_kv_heads),
                "kv_capacity_tokens": self.cache.capacity_tokens}

    def retrieval_task(self, text_path: str | None, context_tokens: int, depth: float, seed: int) -> Any:
        from raysparse.workload import build_retrieval_task, load_haystack_text

        text, source = load_haystack_text(text_path)
        return build_retrieval_task(self.tokenizer, text, source, context_tokens=context_tokens, depth=depth,
                                    seed=seed)

    def generate(self, prompt_ids: list[int], params: dict[str, Any], method: str = "dense",
                 method_params: dict[str, Any] | None = None, request_id: str = "0") -> Iterator[Event]:
        backend = create_backend(method, self.model.cfg, **(method_params or {}))
        request = GenerationRequest(tuple(prompt_ids), SamplingParams(**params), request_id)
        if getattr(backend, "speculative", False):
            from raysparse.specattn import SpecAttnGenerator, resolve_layer_map

            layer_map = resolve_layer_map(self.model, self.model_dir, backend.draft_layers, self.tokenizer)
            gen: Generator = SpecAttnGenerator(self.model, self.cache, backend, self.tokenizer, layer_map=layer_map)
        else:
            gen = Generator(self.model, self.cache, backend, self.tokenizer)
        events: queue.Queue[Event | None] = queue.Queue()
        layers = self.model.cfg.num_layers

        def run() -> None:
            try:
                for ev in gen.generate([request], on_prefill_layer=lambda i: events.put(
                        {"type": "prefill", "layer": i + 1, "layers": layers})):
                    if isinstance(ev, TokenEvent):
                        events.put({"type": "token", "token_id": ev.token_id, "text": ev.text})
                    elif isinstance(ev, FinishEvent):
                        events.put({"type": "finish", **asdict(ev), "decode_tokens_per_s": ev.decode_tokens_per_s,
                                    "method": method, "density": backend.meter.overall(),
                                    "density_per_layer": backend.meter.per_layer(),
                                    "density_decode": backend.meter.decode_overall(),
                                    **({"specattn": backend.stats.to_dict()} if hasattr(backend, "stats") else {})})
            except Exception as e:  # reported to the caller as an event; the worker stays usable
                events.put({"type": "error", "error": f"{type(e).__name__}: {e}"})
            finally:
                events.put(None)

        thread = threading.Thread(target=run, name=f"generate-{request_id}", daemon=True)
        thread.start()
        while (ev := events.get()) is not None:
            yield ev
        thread.join()
