"""Long-context retrieval workloads over real prose: a needle-in-a-haystack question.

The haystack is Jane Austen's novels from ``../shared/data/text/`` (relative to the working directory or the
repository root), or a deterministic synthetic filler when no text is found, so benchmarks and tests run
anywhere. The default task is tuned so that the small default model (SmolLM2-135M-Instruct) answers it
correctly with greedy decoding and dense attention: a sparse method that loses the needle then shows up as
an accuracy drop instead of being hidden by a model that never got it right.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raysparse.generate import chat_prompt_ids

TEXT_DIR = Path("..") / "shared" / "data" / "text"
SYNTHETIC_DESCRIPTION = "synthetic haystack (no text file found)"
MIN_CONTEXT_TOKENS = 256

# The wording was chosen by measuring SmolLM2-135M-Instruct (greedy, 24 new tokens, dense attention): a
# "special magic number" needle announced before the haystack and asked for after it, "answer with the
# number only" in the question, and the template's own system prompt, which beat a custom one at 4K-6K
# tokens. It answers 30/30 of 10 seeds x depths 0.1/0.5/0.9 at 2K, 4K and 6K tokens (20/30 at 8K, where
# early needles are lost). Seven digits make a chance hit, or one copied from the prose, implausible.
NEEDLE_DIGITS = 7
NEEDLE_TEMPLATE = "The special magic number is {value}."
INTRO = "Below is a long text. Somewhere in it a special magic number is hidden. Remember it."
QUESTION = "What is the special magic number mentioned in the text above? Answer with the number only."
SYSTEM: str | None = None


def default_text_dir() -> Path | None:
    """``../shared/data/text/`` beside the working directory or the repository root, if it has .txt files."""
    repo_root = Path(__file__).resolve().parent.parent  # raysparse/ sits at the repository root
    for base in (Path.cwd(), repo_root):
        candidate = base / TEXT_DIR
        if candidate.is_dir() and any(candidate.glob("*.txt")):
            return candidate.resolve()
    return None


def _read_text_file(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"haystack file {str(path)!r} is not UTF-8 text ({e.reason})") from None
    if not text.strip():
        raise ValueError(f"haystack file {str(path)!r} is empty")
    return text


def synthetic_haystack(num_sentences: int = 4000, seed: int = 0) -> str:
    """Varied English-like filler with no digits (so a needle's number is the only one)."""
    rng = random.Random(seed)
    subjects = ["The old gardener", "A young officer", "Her elder sister", "The vicar", "Their neighbour",
                "The housekeeper", "A travelling merchant", "His cousin", "The schoolmistress", "Everyone"]
    verbs = ["walked slowly towards", "spoke warmly of", "had long admired", "quietly avoided",
             "wrote a letter about", "could not forget", "laughed at", "was surprised by", "often thought of",
             "returned from"]
    objects = ["the little church by the river", "the ball at the assembly rooms", "the orchard",
               "a rainy afternoon in the village", "the new curtains in the parlour", "the market town",
               "an unexpected visit from London", "the garden party", "the long winter evenings",
               "the library"]
    tails = ["", " before dinner", " with some reluctance", " in great spirits", " for the third time",
             " without telling anyone", " as the bells rang", " while the others played cards"]
    paragraphs: list[str] = []
    sentences: list[str] = []
    for _ in range(num_sentences):
        words = (rng.choice(subjects), rng.choice(verbs), rng.choice(objects))
        sentences.append(" ".join(words) + rng.choice(tails) + ".")
        if rng.random() < 0.2:  # paragraphs of a few sentences, like prose
            paragraphs.append(" ".join(sentences))
            sentences = []
    paragraphs.append(" ".join(sentences))
    return "\n\n".join(p for p in paragraphs if p)


def load_haystack_text(path: str | Path | None) -> tuple[str, str]:
    """(text, description) from a .txt file, a directory of them (sorted, concatenated) or the default."""
    if path is None:
        found = default_text_dir()
        if found is None:
            return synthetic_haystack(), SYNTHETIC_DESCRIPTION
        path = found
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"haystack path {str(p)!r} does not exist")
    files = sorted(p.glob("*.txt")) if p.is_dir() else [p]
    if not files:
        raise ValueError(f"haystack directory {str(p)!r} holds no .txt files")
    text = "\n\n".join(_read_text_file(f) for f in files)
    return text, f"{len(files)} text file(s) from {p} ({len(text):,} characters)"


# A sentence ends at . ! or ? (perhaps inside a closing quote) followed by space and a capital or an opening
# quote, but not after a title such as "Mr." that Austen uses on every page, nor after an initial.
_SENTENCE_END = re.compile(
    r"(?<!\bMr\.)(?<!\bMrs\.)(?<!\bDr\.)(?<!\bSt\.)(?<![A-Z]\.)"
    r"(?:(?<=[.!?])|(?<=[.!?][\"'\u201d\u2019)]))\s+(?=[A-Z\"'\u201c\u2018(])")


@functools.lru_cache(maxsize=4)
def _units(text: str) -> tuple[tuple[str, bool], ...]:
    """The text as (sentence, ends_paragraph) pairs; hard-wrapped lines inside a paragraph are rejoined."""
    units: list[tuple[str, bool]] = []
    for para in re.split(r"\n\s*\n", text):
        flat = " ".join(para.split()).replace("_", "")  # Gutenberg marks italics with underscores
        if not flat:
            continue
        parts = [s for s in _SENTENCE_END.split(flat) if s]
        units.extend((s, i == len(parts) - 1) for i, s in enumerate(parts))
    return tuple(units)


def _join(units: list[tuple[str, bool]]) -> str:
    out: list[str] = []
    for i, (sentence, ends_para) in enumerate(units):
        out.append(sentence)
        if i < len(units) - 1:
            out.append("\n\n" if ends_para else " ")
    return "".join(out)


@dataclass(frozen=True)
class RetrievalTask:
    prompt_ids: tuple[int, ...]
    question: str
    answer: str
    needle_depth: float  # where the needle actually landed: its token offset / haystack tokens
    context_tokens: int  # the requested size; len(prompt_ids) is within a few percent of it
    source: str

    def is_correct(self, output_text: str) -> bool:
        """The exact value appears in the output as a whole number (not as part of a longer one)."""
        return re.search(rf"(?<!\d){re.escape(self.answer)}(?!\d)", output_text) is not None


def _prompt(tokenizer: Any, haystack: str) -> list[int]:
    return chat_prompt_ids(tokenizer, f"{INTRO}\n\n{haystack}\n\n{QUESTION}", system=SYSTEM)


def _with_needle(units: list[tuple[str, bool]], counts: list[int], needle: str,
                 depth: float) -> tuple[str, float]:
    """The haystack with the needle as its own paragraph near ``depth``; (text, the depth it landed at).

    A paragraph break within 3% of the target is preferred to a sentence break, so the needle does not
    split a speech from its "said Mrs. Bennet".
    """
    offsets = [0]
    for n in counts:
        offsets.append(offsets[-1] + n)
    total, target = offsets[-1], depth * offsets[-1]
    breaks = range(len(units) + 1)  # a break before unit i; 0 and len(units) are the two ends
    at = min(breaks, key=lambda i: abs(offsets[i] - target))
    paragraph = [i for i in breaks if i in (0, len(units)) or units[i - 1][1]]
    near = min(paragraph, key=lambda i: abs(offsets[i] - target))
    if abs(offsets[near] - target) <= 0.03 * total:
        at = near
    parts = (_join(units[:at]), needle, _join(units[at:]))
    return "\n\n".join(p for p in parts if p), offsets[at] / max(1, total)


def build_retrieval_task(tokenizer: Any, text: str, source: str, context_tokens: int = 4096,
                         depth: float = 0.5, seed: int = 0) -> RetrievalTask:
    """A needle-in-a-haystack question over about ``context_tokens`` prompt tokens of ``text``.

    ``seed`` picks both where in the text the haystack starts and the needle's value; ``depth`` (0..1) is
    the needle's relative position inside the haystack.
    """
    if type(context_tokens) is not int or context_tokens < MIN_CONTEXT_TOKENS:  # not bool or float
        raise ValueError(f"context_tokens must be an integer >= {MIN_CONTEXT_TOKENS}, got {context_tokens!r}")
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be a number in [0, 1], got {depth!r}")
    units = _units(text)
    if not units:
        raise ValueError("haystack text holds no sentences")
    rng = random.Random(seed)
    value = str(rng.randrange(10 ** (NEEDLE_DIGITS - 1), 10**NEEDLE_DIGITS))
    while value in text:  # the number must be unique in the prompt, or the answer is ambiguous
        value = str(rng.randrange(10 ** (NEEDLE_DIGITS - 1), 10**NEEDLE_DIGITS))
    needle = NEEDLE_TEMPLATE.format(value=value)
    budget = context_tokens - len(_prompt(tokenizer, needle))
    if budget < 64:
        raise ValueError(f"context_tokens={context_tokens} leaves no room for a haystack")

    # A window of sentences round a seeded offset (wrapping round a short text), the offset just after a
    # paragraph break so the haystack does not open mid-scene. English prose runs about four characters a
    # token, so six characters a token over-fills the window safely.
    start = rng.randrange(len(units))
    for k in range(30):
        if units[(start + k) % len(units)][1]:
            start += k + 1
            break
    lead = 40
    window = [units[(start - lead + i) % len(units)] for i in range(lead)]
    chars = -sum(len(u[0]) + 1 for u in window)
    while chars < 6 * budget:
        window.append(units[(start + len(window) - lead) % len(units)])
        chars += len(window[-1][0]) + 1
    # A sentence alone tokenizes like it does inside the text (its leading space merges into its first
    # token); a paragraph break adds one "\n\n" token. The exact prompt is measured below anyway.
    encoded = tokenizer([u[0] for u in window], add_special_tokens=False)["input_ids"]
    counts = [len(ids) + int(u[1]) for ids, u in zip(encoded, window, strict=True)]
    # The run of whole sentences that fills the budget best, starting at most ``lead`` sentences either
    # side of the seeded start: with long sentences a fixed start can fall well short of the budget.
    lo, hi, best_fill = lead, lead, -1
    right, fill = 0, 0
    for left in range(2 * lead):
        while right < len(window) and fill + counts[right] <= budget:
            fill, right = fill + counts[right], right + 1
        if fill > best_fill or (fill == best_fill and abs(left - lead) < abs(lo - lead)):
            lo, hi, best_fill = left, right, fill
        if right == left:
            right += 1
        else:
            fill -= counts[left]
    best: tuple[list[int], float] | None = None
    for _ in range(20):  # converges in a few rounds; the bound only guards against a loop
        haystack, placed = _with_needle(window[lo:hi], counts[lo:hi], needle, depth)
        ids = _prompt(tokenizer, haystack)
        slack = context_tokens - len(ids)
        if slack >= 0 and (best is None or len(ids) > len(best[0])):
            best = (ids, placed)
        if slack < 0:  # over: drop whole sentences at either end, the shorter one that covers the excess
            if hi - lo <= 1:
                break
            while slack < 0 and hi - lo > 1:
                first, last = counts[lo], counts[hi - 1]
                if last + slack >= 0 and (first + slack < 0 or last <= first):
                    hi, slack = hi - 1, slack + last
                elif first + slack >= 0 or first > last:
                    lo, slack = lo + 1, slack + first
                else:
                    hi, slack = hi - 1, slack + last
            continue
        grew = False
        while hi < len(window) and counts[hi] <= slack:
            slack, hi, grew = slack - counts[hi], hi + 1, True
        while lo > 0 and counts[lo - 1] <= slack:  # the end is blocked by a long sentence: extend the start
            slack, lo, grew = slack - counts[lo - 1], lo - 1, True
        if not grew:
            break
    if best is None:
        raise ValueError(f"could not fit a haystack into context_tokens={context_tokens}")
    return RetrievalTask(tuple(best[0]), QUESTION, value, best[1], context_tokens, source)
