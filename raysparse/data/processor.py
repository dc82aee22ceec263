"""Ray Data batch inference on raysparse engines, in the shape of ``ray.data.llm``'s processors.

``build_processor(ProcessorConfig(...))`` gives a ``Processor``; ``processor(ds)`` maps a ``ray.data.Dataset``
through a pool of engine actors (``EngineStage``), streaming: each actor holds one ``Engine`` of one
tensor-parallel group (its shards in a placement group of their own, as every engine places them), and takes
``batch_size`` rows at a time, submitted together so they batch in the engine; an actor serves
``IN_FLIGHT`` batches at once (threads of its own), so the engine batches across them too. Blocks go to the
least busy actor (the first one up takes them until the others are, unless Ray Data waits for the pool's
minimum: ``DataContext.wait_for_min_actors_s``); a dataset read as one block, e.g. a small file, reaches one
actor (``override_num_blocks`` at the read, or ``repartition``, spreads it). The pool has ``replicas``
actors, or grows between ``min_replicas`` and ``max_replicas`` with the dataset's backlog (Ray Data's actor
pool autoscaling).

A row gives its prompt as one of ``prompt`` (text), ``messages`` (chat messages, through the model's chat
template), ``prompt_ids`` or ``document`` plus ``question``, and may carry ``id``, ``method``,
``method_params`` and ``sampling`` as the JSONL job's lines do: the row logic is the job's
(``jobs.records.parse_object``). Out come the row's columns and ``generated_text``, ``generated_token_ids``,
``num_input_tokens``, ``num_generated_tokens``, ``finish_reason``, ``density_prefill``, ``density_decode``,
``engine`` (the name of the engine actor that served it) and ``error``: a row that cannot be served (a bad
field, an engine refusal, a failed request) gets its reason there and ``finish_reason`` "error", and the other
rows go on, never a failed job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

OUTPUT_COLUMNS = ("generated_text", "generated_token_ids", "num_input_tokens", "num_generated_tokens",
                  "finish_reason", "density_prefill", "density_decode", "error", "engine")


IN_FLIGHT = 2  # batches an engine actor serves at once


@dataclass(frozen=True)
class ProcessorConfig:
    """What the processor runs: the model and its engine (``engine``: any other ``EngineConfig`` field, e.g.
    ``kv_cache_tokens``, ``dtype``, ``cpus_per_shard``), the pool of engine actors, the file-wide method,
    parameters and sampling (``SamplingParams`` fields), rows per batch and whether text prompts go through
    the chat template."""

    model: str
    tp: int = 1
    replicas: int = 1
    min_replicas: int | None = None  # with max_replicas: an autoscaling pool instead of ``replicas`` actors
    max_replicas: int | None = None
    method: str = "dense"
    method_params: Mapping[str, Any] = field(default_factory=dict)
    sampling: Mapping[str, Any] = field(default_factory=dict)
    batch_size: int = 16
    chat: bool = True
    engine: Mapping[str, Any] = field(default_factory=dict)
    actor_cpus: float = 0.0  # the stage actor's own; the shards reserve theirs (``cpus_per_shard``)
    timeout_s: float = 3600.0  # per row

    def __post_init__(self) -> None:
        from raysparse.methods.registry import check_param_values

        if self.batch_size < 1 or self.replicas < 1 or self.tp < 1:
            raise ValueError("batch_size, replicas and tp must be positive")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("give min_replicas and max_replicas together (an autoscaling pool), or replicas")
        if self.min_replicas is not None and not 1 <= self.min_replicas <= self.max_replicas:  # type: ignore[operator]
            raise ValueError("need 1 <= min_replicas <= max_replicas")
        check_param_values(self.method, dict(self.method_params))  # before any actor starts


class EngineStage:
    """One actor of the pool: an engine of one tensor-parallel group, serving batches of rows."""

    def __init__(self, cfg: ProcessorConfig) -> None:
        from raysparse.jobs.records import JobDefaults
        from raysparse.orchestration.engine import Engine, EngineConfig

        self.cfg = cfg
        self.defaults = JobDefaults(cfg.method, dict(cfg.method_params), dict(cfg.sampling), cfg.chat)
        self.engine = Engine(EngineConfig(model=cfg.model, tp=cfg.tp, replicas=1, **dict(cfg.engine))).start()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    def _chat_ids(self, messages: Any) -> list[int]:
        from raysparse.jobs.records import BadLine

        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise BadLine("this model has no chat template: give prompt or prompt_ids")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages) or not messages:
            raise BadLine("messages must be a non-empty list of {role, content} objects")
        text = tok.apply_chat_template([{"role": m.get("role"), "content": m.get("content")} for m in messages],
                                       add_generation_prompt=True, tokenize=False)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def _submit(self, row: dict[str, Any], n: int) -> Any:
        """The row's handle; raises (BadLine, the engine's refusal) with the row's error."""
        from raysparse.jobs.records import parse_object
        from raysparse.orchestration.engine_api import EngineRequest

        obj = {k: v for k, v in row.items() if v is not None and k not in OUTPUT_COLUMNS}
        if "messages" in obj:
            obj["prompt_ids"] = self._chat_ids(obj.pop("messages"))
        item = parse_object(obj, n, self.defaults, lambda text, chat: self.engine.encode(text, chat=chat),
                            str(obj.get("id", n)))
        return self.engine.submit(EngineRequest(item.prompt_ids, item.params, item.method, item.method_params))

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        rows = batch.to_pylist()
        handles: list[Any] = []
        for n, row in enumerate(rows):
            try:
                handles.append(self._submit(row, n))
            except Exception as e:  # noqa: BLE001 - the row's error, in one line
                handles.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
        out: list[dict[str, Any]] = []
        for h in handles:
            res: dict[str, Any] = {**dict.fromkeys(OUTPUT_COLUMNS), "engine": self.engine.name}
            if isinstance(h, str):
                res.update(finish_reason="error", error=h)
            else:
                try:
                    fin = h.result(self.cfg.timeout_s)
                except TimeoutError:
                    h.abort()
                    res.update(finish_reason="error", error=f"timed out after {self.cfg.timeout_s:.0f} s")
                else:
                    density = fin.stats.get("density", {})
                    res.update(generated_text=fin.text, generated_token_ids=list(fin.token_ids),
                               num_input_tokens=fin.prompt_tokens, num_generated_tokens=len(fin.token_ids),
                               finish_reason=fin.finish_reason, density_prefill=density.get("prefill"),
                               density_decode=density.get("decode"), error=fin.error or None)
            out.append(res)
        table = batch.drop_columns([c for c in OUTPUT_COLUMNS if c in batch.column_names])
        for name, kind in _output_types(pa):  # typed, so every batch has one schema whatever its rows gave
            table = table.append_column(pa.field(name, kind), pa.array([r[name] for r in out], type=kind))
        return table


def _output_types(pa: Any) -> list[tuple[str, Any]]:
    return [("generated_text", pa.string()), ("generated_token_ids", pa.list_(pa.int64())),
            ("num_input_tokens", pa.int64()), ("num_generated_tokens", pa.int64()), ("finish_reason", pa.string()),
            ("density_prefill", pa.float64()), ("density_decode", pa.float64()), ("error", pa.string()),
            ("engine", pa.string())]


class Processor:
    """``processor(ds)``: the dataset's rows through the pool of engine actors (lazy, as every Ray Data step)."""

    def __init__(self, cfg: ProcessorConfig) -> None:
        self.cfg = cfg

    def __call__(self, ds: Any) -> Any:
        import ray.data

        c = self.cfg
        size = (c.min_replicas, c.max_replicas) if c.min_replicas is not None else (c.replicas, c.replicas)
        return ds.map_batches(EngineStage, fn_constructor_kwargs={"cfg": c}, batch_size=c.batch_size,
                              batch_format="pyarrow", num_cpus=c.actor_cpus, max_concurrency=IN_FLIGHT,
                              compute=ray.data.ActorPoolStrategy(min_size=size[0], max_size=size[1],
                                                                 max_tasks_in_flight_per_actor=IN_FLIGHT))


def build_processor(cfg: ProcessorConfig) -> Processor:
    return Processor(cfg)
