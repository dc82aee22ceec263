"""The JSONL records of ``raysparse.jobs.longcontext``: one input line into an engine request, one result
or error into an output line. Everything here is pure, so every rule is testable without Ray."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raysparse.sampling import SamplingParams

DOCUMENT_TEMPLATE = "Read the document and answer the question.\n\n<document>\n{document}\n</document>\n\n" \
                    "Question: {question}"
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "seed", "stop_token_ids", "ignore_eos")


class BadLine(ValueError):
    """An input line that cannot become a request; it is written as an error line."""


@dataclass(frozen=True)
class JobDefaults:
    method: str = "dense"
    method_params: Mapping[str, Any] = field(default_factory=dict)
    sampling: Mapping[str, Any] = field(default_factory=dict)
    chat: bool = True


@dataclass(frozen=True)
class Item:
    id: str
    line: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    method: str
    method_params: tuple[tuple[str, Any], ...]


def line_id(obj: Any, line: int) -> str:
    if isinstance(obj, dict) and obj.get("id") is not None:
        return str(obj["id"])
    return f"line-{line}"


def parse_line(raw: str, line: int, defaults: JobDefaults, encode: Callable[[str, bool], list[int]]) -> Item:
    """One input line -> Item; raises BadLine with the reason. ``encode(text, chat)`` tokenizes."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise BadLine(f"not JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(obj, dict):
        raise BadLine("a line must be a JSON object")
    rid = line_id(obj, line)
    chat = bool(obj.get("chat", defaults.chat))
    kinds = [k for k in ("prompt", "prompt_ids", "document") if obj.get(k) is not None]
    if len(kinds) != 1:
        raise BadLine("give exactly one of prompt, prompt_ids, or document with question")
    if kinds == ["prompt_ids"]:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadLine("prompt_ids must be a list of integers")
    else:
        if kinds == ["document"]:
            doc, q = obj.get("document"), obj.get("question")
            if not isinstance(doc, str) or not isinstance(q, str) or not doc.strip() or not q.strip():
                raise BadLine("document and question must be non-empty strings")
            text = DOCUMENT_TEMPLATE.format(document=doc, question=q)
        else:
            text = obj["prompt"]
            if not isinstance(text, str):
                raise BadLine("prompt must be a string")
        if not text.strip():
            raise BadLine("prompt is empty")
        ids = encode(text, chat)
    if not ids:
        raise BadLine("prompt is empty")
    sampling = obj.get("sampling", {})
    if not isinstance(sampling, dict) or set(sampling) - set(SAMPLING_KEYS):
        raise BadLine(f"sampling must be an object with keys among {', '.join(SAMPLING_KEYS)}")
    merged = {**defaults.sampling, **sampling}
    if "stop_token_ids" in merged:
        merged["stop_token_ids"] = tuple(merged["stop_token_ids"])
    try:
        params = SamplingParams(**merged)
    except (TypeError, ValueError) as e:
        raise BadLine(f"bad sampling: {e}") from None
    method = obj.get("method", defaults.method)
    mp = obj.get("method_params", defaults.method_params if "method" not in obj else {})
    if not isinstance(method, str) or not method:
        raise BadLine("method must be a non-empty string")
    if not isinstance(mp, dict):
        raise BadLine("method_params must be an object")
    mp = {k: tuple(v) if isinstance(v, list) else v for k, v in mp.items()}
    return Item(rid, line, tuple(ids), params, method, tuple(sorted(mp.items())))


def result_line(item: Item, fin: Any) -> dict[str, Any]:
    return {"id": item.id, "text": fin.text, "token_ids": list(fin.token_ids), "finish_reason": fin.finish_reason,
            "prompt_tokens": fin.prompt_tokens, "completion_tokens": len(fin.token_ids),
            "ttft_s": round(fin.ttft_s, 6), "decode_s": round(fin.decode_s, 6), "method": item.method,
            "method_params": dict(item.method_params), "error": fin.error or None}


def error_line(rid: str, line: int, error: str) -> dict[str, Any]:
    return {"id": rid, "line": line, "finish_reason": "error", "error": error}


def finished_ids(output: Path) -> set[str]:
    """Ids already written to ``output`` (a torn last line from a crash is ignored and rewritten)."""
    done: set[str] = set()
    if not output.exists():
        return done
    for raw in output.read_text(encoding="utf-8").splitlines():
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "id" in obj:
            done.add(str(obj["id"]))
    return done
