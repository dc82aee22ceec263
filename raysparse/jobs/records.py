"""The JSONL records of ``raysparse.jobs.longcontext``: one input line into an engine request, one result
or error into an output line, and the rules that key output lines to input lines. Everything here is pure
(or reads and repairs the output file), so every rule is testable without Ray.

Keys. Every non-blank input line has an id: its own ``id`` (as a string), or, for a line without one or
one that is not a JSON object in UTF-8, ``line-N`` (N its 1-based line number), made unique against the
file's own ids by a ``~K`` suffix (``line-3~1``, ``line-3~2``, ...) where a user line already claims it; the
ids are a function of the input file, so a rerun over the same file gives the same ids. The first line with
an id owns it: its result or error line is keyed by ``id``. Each later line with the same id gets one error
line with ``duplicate_of_line`` (the owner's line number) and ``line``, keyed by (``id``, ``line``). The
output thus holds exactly one line per distinct id without ``duplicate_of_line``, and one line per later
duplicate.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raysparse.sampling import SamplingParams

DOCUMENT_TEMPLATE = "Read the document and answer the question.\n\n<document>\n{document}\n</document>\n\n" \
                    "Question: {question}"
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "seed", "stop_token_ids", "ignore_eos")
MAX_ERROR_CHARS = 2000  # an exception may quote a whole long-context prompt; the error line need not


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


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def loads(raw: str) -> Any:
    """``json.loads`` that refuses NaN and Infinity (they are not JSON, and would reach the sampler); raises
    BadLine for anything that is not a JSON value, a nesting too deep for the parser included."""
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise BadLine(f"not JSON: {e.msg} at column {e.colno}") from None
    except (ValueError, RecursionError) as e:
        raise BadLine(f"not JSON: {e}") from None


def user_id(obj: Any) -> str | None:
    """The line's own id, or None when it has none."""
    if isinstance(obj, dict) and obj.get("id") is not None:
        return str(obj["id"])
    return None


def line_id(obj: Any, line: int) -> str:
    rid = user_id(obj)
    return f"line-{line}" if rid is None else rid


def split_lines(data: bytes) -> list[tuple[int, str | None]]:
    """The non-blank lines of a JSONL file as (1-based line number, text), text None where the line is not
    UTF-8. It splits on newlines only: ``str.splitlines`` would also split at U+2028 and friends, which
    JSON strings may hold unescaped."""
    lines: list[tuple[int, str | None]] = []
    for n, chunk in enumerate(data.split(b"\n"), start=1):
        chunk = chunk.removesuffix(b"\r")
        if not chunk.strip():
            continue
        try:
            lines.append((n, chunk.decode("utf-8")))
        except UnicodeDecodeError:
            lines.append((n, None))
    return lines


def document_key(raw: str | None) -> str | None:
    """The document a ``document`` + ``question`` line asks about (None for any other line, or a bad one)."""
    try:
        obj = loads(raw) if raw is not None else None
    except BadLine:
        return None
    doc = obj.get("document") if isinstance(obj, dict) else None
    return doc if isinstance(doc, str) else None


def by_document(lines: list[tuple[int, str | None]]) -> list[list[tuple[int, str | None]]]:
    """The lines grouped by their document, groups in the order of their first line and lines in file order
    within a group; every other line is a group of its own. Questions about one document then run one after
    another, so the engine's prefix cache serves the document's pages to all but the first."""
    groups: dict[Any, list[tuple[int, str | None]]] = {}
    for n, raw in lines:
        doc = document_key(raw)
        groups.setdefault(("doc", doc) if doc is not None else ("line", n), []).append((n, raw))
    return list(groups.values())


def assign_ids(lines: list[tuple[int, str | None]]) -> dict[int, str]:
    """Line number -> id for every line (see the module docstring): generated ids never equal a user id."""
    own: dict[int, str | None] = {}
    for n, raw in lines:
        try:
            own[n] = user_id(loads(raw)) if raw is not None else None
        except BadLine:
            own[n] = None
    taken = {rid for rid in own.values() if rid is not None}
    ids: dict[int, str] = {}
    for n, rid in own.items():
        if rid is None:
            # line numbers are unique, so ``line-N`` and ``line-N~K`` never clash with another line's
            rid, k = f"line-{n}", 0
            while rid in taken:
                k += 1
                rid = f"line-{n}~{k}"
        ids[n] = rid
    return ids


def parse_line(raw: str, line: int, defaults: JobDefaults, encode: Callable[[str, bool], list[int]],
               rid: str | None = None) -> Item:
    """One input line -> Item; raises BadLine with the reason. ``encode(text, chat)`` tokenizes; ``rid``
    (from ``assign_ids``) overrides the id the line alone would give."""
    obj = loads(raw)
    if not isinstance(obj, dict):
        raise BadLine("a line must be a JSON object")
    return parse_object(obj, line, defaults, encode, line_id(obj, line) if rid is None else rid)


def parse_object(obj: Mapping[str, Any], line: int, defaults: JobDefaults, encode: Callable[[str, bool], list[int]],
                 rid: str) -> Item:
    """One record (a parsed line, or a dataset's row: ``raysparse.data``) -> Item; raises BadLine."""
    chat = bool(obj.get("chat", defaults.chat))
    kinds = [k for k in ("prompt", "prompt_ids", "document") if obj.get(k) is not None]
    if len(kinds) != 1:
        raise BadLine("give exactly one of prompt, prompt_ids, or document with question")
    if kinds == ["prompt_ids"]:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                for t in ids):
            raise BadLine("prompt_ids must be a list of non-negative integers")
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
        try:
            # a lone surrogate such as "\ud800" is valid JSON but no tokenizer takes it
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadLine(f"text is not valid Unicode: {e.reason} at character {e.start}") from None
        ids = encode(text, chat)
    if not ids:
        raise BadLine("prompt is empty")
    sampling = obj.get("sampling", {})
    if not isinstance(sampling, dict) or set(sampling) - set(SAMPLING_KEYS):
        raise BadLine(f"sampling must be an object with keys among {', '.join(SAMPLING_KEYS)}")
    if any(isinstance(v, float) and not math.isfinite(v) for v in sampling.values()):
        raise BadLine("sampling values must be finite")  # 1e999 parses as infinity
    merged = {**defaults.sampling, **sampling}
    if "stop_token_ids" in merged:
        if not isinstance(merged["stop_token_ids"], list | tuple):
            raise BadLine("stop_token_ids must be a list of integers")
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
            "ttft_s": round(fin.ttft_s, 6), "decode_s": round(fin.decode_s, 6),
            "cached_tokens": int(fin.stats.get("cached_tokens", 0)), "method": item.method,
            "method_params": dict(item.method_params), "error": fin.error or None}


def error_line(rid: str, line: int, error: str) -> dict[str, Any]:
    if len(error) > MAX_ERROR_CHARS:
        error = error[:MAX_ERROR_CHARS] + "..."
    return {"id": rid, "line": line, "finish_reason": "error", "error": error}


def duplicate_line(rid: str, line: int, first: int) -> dict[str, Any]:
    """The error line of a later line that repeats line ``first``'s id, keyed by (id, line)."""
    return {**error_line(rid, line, f"duplicate id {rid!r}: line {first} has it"), "duplicate_of_line": first}


def dumps(obj: dict[str, Any]) -> bytes:
    """One output line. Text stays readable (ensure_ascii off) unless it holds a lone surrogate, which UTF-8
    cannot carry: then the line is escaped ASCII, which reads back to the same string."""
    try:
        return (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(obj) + "\n").encode("ascii")


def repair_output(output: Path) -> int:
    """Truncates ``output`` to its last complete line, dropping the torn line a killed run may leave (its id
    is then redone); returns the bytes dropped."""
    if not output.exists():
        return 0
    with output.open("rb+") as f:
        size = f.seek(0, os.SEEK_END)
        end, step = size, 1 << 16
        while end > 0:  # the last newline, read backwards: the file may be large, the tail is short
            start = max(0, end - step)
            f.seek(start)
            nl = f.read(end - start).rfind(b"\n")
            if nl >= 0:
                end = start + nl + 1
                break
            end = start
        if end < size:
            f.truncate(end)
        return size - end


@dataclass
class Finished:
    """What an output file already holds: owners' ids, and (id, line) of duplicate lines' error lines."""
    ids: set[str] = field(default_factory=set)
    duplicates: set[tuple[str, int]] = field(default_factory=set)


def finished(output: Path) -> Finished:
    """The keys already written to ``output``; lines that are not JSON objects with an id are ignored (a torn
    last line is cut off by ``repair_output`` first)."""
    done = Finished()
    if not output.exists():
        return done
    for chunk in output.read_bytes().split(b"\n"):
        try:
            obj = json.loads(chunk.decode("utf-8"))
        except (ValueError, RecursionError):
            continue
        if not isinstance(obj, dict) or "id" not in obj:
            continue
        if isinstance(obj.get("duplicate_of_line"), int) and isinstance(obj.get("line"), int):
            done.duplicates.add((str(obj["id"]), obj["line"]))
        else:
            done.ids.add(str(obj["id"]))
    return done


def finished_ids(output: Path) -> set[str]:
    """Ids already written to ``output`` by the lines that own them (a torn last line is ignored)."""
    return finished(output).ids
