"""RULER-style retrieval tasks generated over real prose, plus the perplexity windows.

Every task hides short "needle" statements as their own paragraphs inside a haystack of real text (any
text file; the synthetic filler of ``raysparse.workload`` when none is found), asks one question after the
haystack through the model's chat template and is scored exactly: the fraction of the expected strings that
appear in the output as whole words (``score``). Values are 7-digit numbers and variable names are random
5-letter capitals, each checked to occur nowhere in the source text, so an answer cannot come from the prose.

Tasks (names are what ``--tasks`` takes):
- ``single_needle``: one magic number (the wording of ``raysparse.workload``, measured on the default model).
- ``multi_key``: four "magic number for <key>" needles with different keys; the question names one key.
- ``multi_value``: four needles with the same key and different numbers; all four must be returned.
- ``variable_tracking``: a chain ``VAR A = 1234567.``, ``VAR B = A.``, ... plus a distractor chain with
  another value; the question asks for every variable that resolves to the chain's value.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raysparse.generate import chat_prompt_ids

# The workload's sentence splitting (_units, _join), so the harness reads text exactly as `raysparse run` does.
from raysparse.workload import (
    INTRO,
    MIN_CONTEXT_TOKENS,
    NEEDLE_DIGITS,
    NEEDLE_TEMPLATE,
    QUESTION,
    SYSTEM,
    _join,
    _units,
)

TASK_NAMES = ("single_needle", "multi_key", "multi_value", "variable_tracking")
NUM_KEYS = 4  # needles of multi_key (one is asked for, the others are distractors)
NUM_VALUES = 4  # values of the one key of multi_value
CHAIN_HOPS = 4  # variables in the tracked chain (and in the distractor chain)

# Two-word keys are all but impossible in Austen's prose, so a key never collides with the haystack.
_KEY_A = ["amber", "azure", "coral", "crimson", "golden", "ivory", "jade", "scarlet", "silver", "violet"]
_KEY_B = ["falcon", "harbour", "lantern", "meadow", "orchid", "pebble", "quartz", "sparrow", "thistle", "willow"]


@dataclass(frozen=True)
class EvalTask:
    name: str
    seed: int
    prompt_ids: tuple[int, ...]
    question: str
    expected: tuple[str, ...]  # every string the answer must contain
    needles: tuple[str, ...]  # the statements hidden in the haystack, in text order
    context_tokens: int  # the requested size; len(prompt_ids) is at most this
    source: str
    answer_tokens: int  # tokens of the expected strings alone, joined by ", ": generation needs at least this


    def score(self, output: str) -> float:
        """Fraction of ``expected`` present in ``output`` as whole words (not inside a longer number/name)."""
        hits = sum(re.search(rf"(?<![A-Za-z0-9]){re.escape(e)}(?![A-Za-z0-9])", output) is not None
                   for e in self.expected)
        return hits / len(self.expected)


def _fresh_number(rng: random.Random, text: str, taken: set[str]) -> str:
    lo, hi = 10 ** (NEEDLE_DIGITS - 1), 10**NEEDLE_DIGITS - 1
    while True:
        v = str(rng.randint(lo, hi))
        if v not in text and v not in taken:
            taken.add(v)
            return v


def _fresh_name(rng: random.Random, text: str, taken: set[str]) -> str:
    while True:
        v = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if v not in text and v not in taken:
            taken.add(v)
            return v


def _fresh_keys(rng: random.Random, text: str, count: int) -> list[str]:
    """Keys that share no word with each other: a small model confuses "coral-meadow" with "coral-orchid"."""
    while True:
        keys = [f"{a}-{b}" for a, b in zip(rng.sample(_KEY_A, count), rng.sample(_KEY_B, count), strict=True)]
        if not any(k in text for k in keys):
            return keys


@dataclass(frozen=True)
class _Spec:
    """What a task generator decides before the haystack is fitted around its needles."""

    intro: str
    question: str
    answer_hint: str  # the one-line instruction after the question
    needles: list[str]  # in the order they must appear
    expected: tuple[str, ...]


def _single_needle(rng: random.Random, text: str) -> _Spec:
    v = _fresh_number(rng, text, set())
    q, hint = QUESTION.split("? ", 1)
    return _Spec(INTRO, q + "?", hint, [NEEDLE_TEMPLATE.format(value=v)], (v,))


def _multi_key(rng: random.Random, text: str) -> _Spec:
    taken: set[str] = set()
    keys = _fresh_keys(rng, text, NUM_KEYS)
    values = [_fresh_number(rng, text, taken) for _ in range(NUM_KEYS)]
    ask = rng.randrange(NUM_KEYS)
    needles = [f"The special magic number for {k} is {v}." for k, v in zip(keys, values, strict=True)]
    return _Spec("Below is a long text. Special magic numbers for different keys are hidden in it. Remember them.",
                 f"What is the special magic number for {keys[ask]} mentioned in the text above?",
                 "Answer with the number only.", needles, (values[ask],))


def _multi_value(rng: random.Random, text: str) -> _Spec:
    taken: set[str] = set()
    (key,) = _fresh_keys(rng, text, 1)
    values = [_fresh_number(rng, text, taken) for _ in range(NUM_VALUES)]
    needles = [f"One of the special magic numbers for {key} is {v}." for v in values]
    return _Spec("Below is a long text. Several special magic numbers are hidden in it. Remember them.",
                 f"What are all the special magic numbers for {key} mentioned in the text above?",
                 "Answer with the numbers only.", needles, tuple(values))


def _variable_tracking(rng: random.Random, text: str) -> _Spec:
    taken: set[str] = set()

    def chain() -> tuple[list[str], str, list[str]]:
        names = [_fresh_name(rng, text, taken) for _ in range(CHAIN_HOPS)]
        value = _fresh_number(rng, text, taken)
        copies = [f"VAR {b} = {a}." for a, b in zip(names, names[1:], strict=False)]
        return names, value, [f"VAR {names[0]} = {value}.", *copies]

    names, asked, tracked = chain()
    chains = [tracked, chain()[2]]  # the tracked chain and a distractor chain with its own value
    # Interleave the two chains at random while keeping each chain's order, so every assignment comes after
    # the one it copies from: a reader going front to back can always resolve the chain.
    order = [0] * CHAIN_HOPS + [1] * CHAIN_HOPS
    rng.shuffle(order)
    pos = [0, 0]
    needles = []
    for c in order:
        needles.append(chains[c][pos[c]])
        pos[c] += 1
    return _Spec("Below is a long text. Variable assignments are hidden in it. Memorize them and track the "
                 "changes.", f"Find all variables that are assigned the value {asked} in the text above.",
                 "Answer with the variable names only, separated by spaces.", needles, tuple(names))


GENERATORS: dict[str, Callable[[random.Random, str], _Spec]] = {
    "single_needle": _single_needle, "multi_key": _multi_key, "multi_value": _multi_value,
    "variable_tracking": _variable_tracking,
}


def _place(units: list[tuple[str, bool]], counts: list[int], needles: list[str], depths: list[float]) -> str:
    """The haystack with each needle as its own paragraph at the break nearest its depth (ascending depths
    keep the needles' order). A paragraph break within 3% of the target is preferred to a sentence break."""
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    total = offsets[-1]
    breaks = range(len(units) + 1)
    paragraph = [i for i in breaks if i in (0, len(units)) or units[i - 1][1]]
    at_break: dict[int, list[str]] = {}
    last = 0
    for needle, depth in zip(needles, depths, strict=True):
        target = depth * total
        at = min((i for i in breaks if i >= last), key=lambda i: abs(offsets[i] - target))
        near = min((i for i in paragraph if i >= last), key=lambda i: abs(offsets[i] - target), default=at)
        if abs(offsets[near] - target) <= 0.03 * total:
            at = near
        at_break.setdefault(at, []).append(needle)
        last = at
    parts: list[str] = []
    prev = 0
    for at in sorted(at_break):
        parts.append(_join(units[prev:at]))
        parts.extend(at_break[at])
        prev = at
    parts.append(_join(units[prev:]))
    return "\n\n".join(p for p in parts if p)


def _window(units: tuple[tuple[str, bool], ...], rng: random.Random, chars: int) -> list[tuple[str, bool]]:
    """Sentences from a seeded offset, starting after a paragraph break (wrapping round a short text)."""
    start = rng.randrange(len(units))
    for k in range(30):
        if units[(start + k) % len(units)][1]:
            start += k + 1
            break
    window: list[tuple[str, bool]] = []
    total = 0
    while total < chars:
        window.append(units[(start + len(window)) % len(units)])
        total += len(window[-1][0]) + 1
    return window


def build_task(name: str, tokenizer: Any, text: str, source: str, context_tokens: int = 2048,
               seed: int = 0) -> EvalTask:
    """Task ``name`` with about ``context_tokens`` prompt tokens (never more). ``seed`` picks the haystack
    offset, the needles' values, keys and depths."""
    if name not in GENERATORS:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASK_NAMES)}")
    if isinstance(context_tokens, bool) or not isinstance(context_tokens, int) or context_tokens < MIN_CONTEXT_TOKENS:
        raise ValueError(f"context_tokens must be an integer >= {MIN_CONTEXT_TOKENS}, got {context_tokens!r}")
    units = _units(text)
    if not units:
        raise ValueError("haystack text holds no sentences")
    rng = random.Random(f"{name}:{seed}")  # a string seed: each task draws its own values for one seed
    spec = GENERATORS[name](rng, text)
    # Needles spread over 10%..90% of the haystack at seeded depths; the ends are left to the template.
    depths = sorted(rng.uniform(0.1, 0.9) for _ in spec.needles)

    def prompt(haystack: str) -> list[int]:
        user = f"{spec.intro}\n\n{haystack}\n\n{spec.question} {spec.answer_hint}"
        return chat_prompt_ids(tokenizer, user, system=SYSTEM)

    budget = context_tokens - len(prompt("\n\n".join(spec.needles)))
    if budget < 64:
        raise ValueError(f"context_tokens={context_tokens} leaves no room for a haystack for task {name!r}")
    # Prose runs about four characters a token, so six characters a token over-fills the window safely.
    window = _window(units, rng, 6 * budget)
    counts = [len(ids) + 1 for ids in tokenizer([u[0] for u in window], add_special_tokens=False)["input_ids"]]
    lo, hi, used = 0, 0, 0
    while hi < len(window) and used + counts[hi] <= budget:
        used, hi = used + counts[hi], hi + 1
    best: list[int] | None = None
    for _ in range(12):  # each round measures the real prompt, then adds or drops what the counts say
        ids = prompt(_place(window[lo:hi], counts[lo:hi], spec.needles, depths))
        slack = context_tokens - len(ids)
        if slack >= 0 and (best is None or len(ids) > len(best)):
            best = ids
        if slack < 0:
            while slack < 0 and hi > lo + 1:
                hi -= 1
                slack += counts[hi]
            if slack < 0 and hi < len(window):
                # One sentence left and it still overflows (the needles' own paragraph breaks cost tokens the
                # counts do not see): try the next sentence instead, which may be shorter.
                lo, hi = hi, hi + 1
            continue
        if hi >= len(window) or counts[hi] > slack:
            break
        while hi < len(window) and counts[hi] <= slack:
            slack, hi = slack - counts[hi], hi + 1
    if best is None:
        raise ValueError(f"could not fit a haystack into context_tokens={context_tokens}: every sentence of the "
                         f"window is longer than the {budget} tokens left beside the needles; raise context_tokens")
    question = f"{spec.question} {spec.answer_hint}"
    answer_tokens = len(tokenizer(", ".join(spec.expected), add_special_tokens=False)["input_ids"])
    return EvalTask(name, seed, tuple(best), question, spec.expected, tuple(spec.needles), context_tokens, source,
                    answer_tokens)


def build_tasks(names: tuple[str, ...], tokenizer: Any, text: str, source: str, context_tokens: int,
                samples: int, seed: int = 0) -> list[EvalTask]:
    """``samples`` tasks of each name, with seeds ``seed .. seed + samples - 1``."""
    return [build_task(n, tokenizer, text, source, context_tokens, seed + s) for n in names for s in range(samples)]


# Perplexity scores the last quarter of each window: those predictions see at least 3/4 of the window as
# context, which is where a sparse method's lost keys matter; the first positions are nearly dense anyway.
PPL_SCORED_FRACTION = 0.25


def perplexity_windows(tokenizer: Any, text: str, tokens: int, samples: int, seed: int = 0) -> list[list[int]]:
    """``samples`` windows of exactly ``tokens`` token ids of plain text (no chat template), each starting
    at a seeded paragraph of ``text`` (wrapping round a short text)."""
    units = _units(text)
    if not units:
        raise ValueError("haystack text holds no sentences")
    out = []
    for s in range(samples):
        rng = random.Random(f"perplexity:{seed + s}")
        chars = 6 * tokens
        while True:
            ids = tokenizer(_join(_window(units, rng, chars)), add_special_tokens=False)["input_ids"]
            if len(ids) >= tokens:
                break
            chars *= 2
        out.append(list(ids[:tokens]))
    return out
