"""One setting's work split into items, each item's result, and the merge into the setting's row.

A setting (one method x density x parameters) is a list of independent work items, in this order: every
task sample, every perplexity window, then every window again for the teacher-forced decode perplexity.
Each item runs on a fresh sequence, so its result does not depend on which items ran before it or where:
the in-process harness runs them in order, the distributed harness (``distributed.py``) spreads them over
replicas. An ``ItemResult`` carries the item's own outputs (a sample, a summed NLL) and the raw sums behind
every run-wide statistic (density meter, fidelity tracer, SpecAttn's counts, CIS's retrievals,
Delta's fitted correction), taken
from the backend after the item alone. Sums are additive over KV heads, so a tensor-parallel item is the
sum of its shards' (``combine_shards``; what every rank computes identically, the sample, the NLL and
SpecAttn's acceptance counts, comes from rank 0), and a setting is the sum of its items in item order
(``merge_items``), whatever the number of replicas.

Errors keep the one-process semantics: the items after the first failing one are dropped, and the fields
that would have been filled before the failure (the accuracy once every task ran, the perplexity once
every window ran, ...) are filled.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from raysparse.attention import AttentionBackend, DenseAttention
from raysparse.eval.metrics import FidelityTracer, _Sums
from raysparse.eval.settings import Setting

KINDS = ("task", "ppl", "decode")


@dataclass
class RunResult:
    method: str
    density_target: float | None
    params: dict[str, Any] = field(default_factory=dict)  # swept method parameters (--method-params)
    label: str = ""  # the method with its swept parameters, for tables
    status: str = "ok"  # "ok" or "error"
    error: str | None = None
    accuracy: float | None = None  # mean task score over every sample of every task
    accuracy_per_task: dict[str, float] = field(default_factory=dict)
    perplexity: float | None = None
    nll: float | None = None  # mean NLL (nats) of the scored tokens
    decode_perplexity: float | None = None  # teacher-forced decode over the last decode_ppl_tokens of each window
    decode_nll: float | None = None
    density: float | None = None  # backend.meter.overall(): attended / causal pairs, all layers, whole run
    density_per_layer: list[float] = field(default_factory=list)
    density_prefill: float | None = None  # the prefill calls alone (what --density targets in prefill)
    density_decode: float | None = None  # the decode steps alone (decode-only methods prefill densely)
    fidelity: dict[str, dict[str, Any]] = field(default_factory=dict)  # FidelityTracer.summary()
    extras: dict[str, Any] = field(default_factory=dict)  # method statistics: "specattn", "cis" (see harness doc)
    samples: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0  # compute time of the setting's items (summed over replicas when spread)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ItemResult:
    kind: str  # "task", "ppl" or "decode"
    index: int  # the task sample or the window
    error: str | None = None
    sample: dict[str, Any] | None = None  # a task's sample row
    nll: float = 0.0  # summed NLL of the scored tokens (ppl, decode)
    count: int = 0
    meter: tuple[list[float], list[float], float, float] | None = None  # attended, causal, decode both
    tracer: dict[tuple[str, int], tuple[float, float, int, float, float]] | None = None
    spec: dict[str, Any] | None = None  # SpecAttnStats fields
    cis: tuple[list[float], list[float]] | None = None  # retrievals, head steps per layer
    delta: tuple[list[float], ...] | None = None  # Delta's fit sums per layer (``Delta.fit_sums``)
    exact: bool = False  # the backend is dense (fidelity 1 / 0 by definition)
    seconds: float = 0.0


def item_order(tasks: int, windows: int, decode: bool) -> list[tuple[str, int]]:
    """Every item of one setting, in the order the one-process harness runs them."""
    return ([("task", i) for i in range(tasks)] + [("ppl", i) for i in range(windows)]
            + ([("decode", i) for i in range(windows)] if decode else []))


def reset_accumulators(backend: AttentionBackend, num_layers: int, rows: int) -> FidelityTracer | None:
    """Zeroes every run-wide sum of ``backend`` before an item; returns the item's tracer (None where the
    backend traces nothing)."""
    backend.meter.reset()
    backend.reset_stats()
    if rows == 0:  # untraced, on the method's fast paths
        return None
    tracer = FidelityTracer(num_layers, rows)
    return tracer if backend.set_tracer(tracer) else None


def snapshot(item: ItemResult, backend: AttentionBackend, tracer: FidelityTracer | None) -> ItemResult:
    """Copies the backend's sums (what the item alone accumulated) into ``item``."""
    m = backend.meter
    item.meter = (list(m.attended), list(m.causal), m.decode_attended, m.decode_causal)
    if tracer is not None:
        item.tracer = {k: (s.retained, s.mass, s.pairs, s.err_sq, s.ref_sq) for k, s in tracer.sums.items()}
    sums = backend.item_sums()
    item.spec, item.cis, item.delta = sums.get("spec"), sums.get("cis"), sums.get("delta")
    item.exact = isinstance(backend, DenseAttention)
    return item


def _add(a: list[float], b: list[float]) -> list[float]:
    return [x + y for x, y in zip(a, b, strict=True)]


def combine_shards(parts: list[ItemResult]) -> ItemResult:
    """One item from every shard of a group, rank order: head-additive sums are summed, the rest is rank 0's."""
    out = ItemResult(**{**parts[0].__dict__})
    out.error = next((p.error for p in parts if p.error is not None), None)
    for p in parts[1:]:
        if out.meter is not None and p.meter is not None:
            out.meter = (_add(out.meter[0], p.meter[0]), _add(out.meter[1], p.meter[1]),
                         out.meter[2] + p.meter[2], out.meter[3] + p.meter[3])
        if out.tracer is not None and p.tracer is not None:
            out.tracer = _sum_tracer(out.tracer, p.tracer)
        if out.spec is not None and p.spec is not None:  # acceptance counts are the same on every rank
            out.spec = {**out.spec, "kv_read": _add(out.spec["kv_read"], p.spec["kv_read"]),
                        "kv_held": _add(out.spec["kv_held"], p.spec["kv_held"]),
                        "draft_kv_read": out.spec["draft_kv_read"] + p.spec["draft_kv_read"],
                        "draft_kv_full": out.spec["draft_kv_full"] + p.spec["draft_kv_full"]}
        if out.cis is not None and p.cis is not None:
            out.cis = (_add(out.cis[0], p.cis[0]), _add(out.cis[1], p.cis[1]))
        if out.delta is not None and p.delta is not None:  # each shard fits its own query heads
            out.delta = tuple(_add(a, b) for a, b in zip(out.delta, p.delta, strict=True))
        out.seconds = max(out.seconds, p.seconds)
    return out


def _sum_tracer(a: dict[Any, tuple], b: dict[Any, tuple]) -> dict[Any, tuple]:
    out = dict(a)
    for k, v in b.items():
        out[k] = tuple(x + y for x, y in zip(out[k], v, strict=True)) if k in out else v
    return out


def _spec_dict(items: list[ItemResult], num_layers: int) -> dict[str, Any]:
    from raysparse.specattn.stats import SpecAttnStats

    first = next(i.spec for i in items if i.spec is not None) if any(i.spec for i in items) else None
    s = SpecAttnStats(num_layers, sparse_layers=tuple(first["sparse_layers"]) if first else ())
    for it in items:
        if it.spec is None:
            continue
        s.rounds += it.spec["rounds"]
        s.drafted += it.spec["drafted"]
        s.accepted += it.spec["accepted"]
        s.kv_read, s.kv_held = _add(s.kv_read, it.spec["kv_read"]), _add(s.kv_held, it.spec["kv_held"])
        s.draft_kv_read += it.spec["draft_kv_read"]
        s.draft_kv_full += it.spec["draft_kv_full"]
    return s.to_dict()


def merge_items(setting: Setting, items: list[ItemResult], num_layers: int, rows: int) -> RunResult:
    """The setting's row from all its items in item order (``item_order``); see the module docstring."""
    from raysparse.attention import DensityMeter

    res = RunResult(setting.method, setting.density, dict(setting.params), setting.label)
    res.seconds = sum(i.seconds for i in items)
    failed = next((n for n, i in enumerate(items) if i.error is not None), None)
    done = items if failed is None else items[:failed]
    tasks = [i for i in done if i.kind == "task"]
    all_tasks = failed is None or items[failed].kind != "task"
    if tasks and all_tasks:
        per_task: dict[str, list[float]] = {}
        for i in tasks:
            per_task.setdefault(i.sample["task"], []).append(i.sample["score"])  # type: ignore[index]
        res.accuracy_per_task = {k: sum(v) / len(v) for k, v in per_task.items()}
    res.samples = [i.sample for i in tasks]  # type: ignore[misc]
    if tasks and all_tasks:
        res.accuracy = sum(s["score"] for s in res.samples) / len(res.samples)
    spec = any(i.spec is not None for i in items)
    if spec and all_tasks:
        first = next(i.spec for i in items if i.spec is not None)
        # which draft picked the chunks (a separate draft model's key), and through which verifier -> draft map
        res.extras["specattn"] = {"draft": first.get("draft") or "self-speculative",
                                  "layer_map": first.get("layer_map"), "generation": _spec_dict(tasks, num_layers)}
    for kind, attr in (("ppl", "nll"), ("decode", "decode_nll")):
        mine = [i for i in items if i.kind == kind]
        if not mine or len([i for i in done if i.kind == kind]) < len(mine):
            continue  # set once every window of the kind ran, as the one-process loop does
        total, count = 0.0, 0
        for i in mine:
            total, count = total + i.nll, count + i.count
        if count:
            setattr(res, attr, total / count)
            setattr(res, "perplexity" if kind == "ppl" else "decode_perplexity", math.exp(total / count))
    if failed is not None:
        res.status, res.error = "error", items[failed].error
        return res
    if spec:
        res.extras["specattn"]["total"] = _spec_dict(items, num_layers)
    cis = [i.cis for i in items if i.cis is not None]
    if cis:
        retr, steps = [0.0] * num_layers, [0.0] * num_layers
        for r, s in cis:
            retr, steps = _add(retr, r), _add(steps, s)
        res.extras["cis"] = {"retrieval_ratio": sum(retr) / sum(steps) if sum(steps) else None,
                             "retrieval_ratio_per_layer": [r / s if s else None for r, s in zip(retr, steps,
                                                                                                 strict=True)]}
    fits = [i.delta for i in items if i.delta is not None]
    if fits:
        from raysparse.methods.delta_rows import fit_summary

        sums = fits[0]
        for f in fits[1:]:
            sums = tuple(_add(a, b) for a, b in zip(sums, f, strict=True))
        res.extras["delta"] = fit_summary(*sums)
    meter = DensityMeter(num_layers)
    for i in items:
        if i.meter is not None:
            meter.attended, meter.causal = _add(meter.attended, i.meter[0]), _add(meter.causal, i.meter[1])
            meter.decode_attended += i.meter[2]
            meter.decode_causal += i.meter[3]
    res.density, res.density_per_layer = meter.overall(), meter.per_layer()
    res.density_prefill, res.density_decode = meter.prefill_overall(), meter.decode_overall()
    if any(i.tracer is not None for i in items):  # a SparseMethod: what its tracer saw (None where nothing)
        tracer = FidelityTracer(num_layers, rows)
        for i in items:
            for k, v in (i.tracer or {}).items():
                s = tracer.sums.setdefault(k, _Sums())
                s.retained, s.mass, s.pairs = s.retained + v[0], s.mass + v[1], s.pairs + v[2]
                s.err_sq, s.ref_sq = s.err_sq + v[3], s.ref_sq + v[4]
        res.fidelity = tracer.summary()
    else:
        res.fidelity = constant_fidelity(num_layers, bool(items) and items[0].exact)
    return res


def constant_fidelity(num_layers: int, exact: bool) -> dict[str, dict[str, Any]]:
    """Dense attends every causal key: retained and attention mass 1, output error 0 by definition. A backend
    that is no ``SparseMethod`` has no tracer hook: its fidelity is unknown (None)."""
    def entry(value: float) -> dict[str, Any]:
        v = value if exact else None
        return {"overall": v, "prefill": v, "decode": v,
                "prefill_per_layer": [v] * num_layers, "decode_per_layer": [v] * num_layers}

    return {"retained": entry(1.0), "attn_mass": entry(1.0), "out_err": entry(0.0)}
