"""What ``raysparse eval`` runs: one ``Setting`` per (method, density, method parameters), dense first.

``--method-params METHOD:KEY=V[,V...]`` (repeatable) sweeps a method's own parameters: every combination of
the listed values is a setting of its own, e.g. ``specattn:top_p=0.95,0.97,0.99`` gives three SpecAttn rows,
``cis:threshold=0.8,2`` gives CIS and CIS that never shares (threshold > 1: per-step oracle top-k).

A method without a density budget runs once per parameter combination, whatever ``--densities`` says, with
no density target: SpecAttn (its budget is ``top_p``), PSAW and ETF (their budget is the depth schedule of
the paper; the meter reports the density it amounts to). A backend says so through
``AttentionBackend.takes_density``.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raysparse.attention import AttentionBackend

ParamSweep = tuple[str, str, tuple[Any, ...]]  # (method, key, values)


@dataclass(frozen=True)
class Setting:
    method: str
    density: float | None = None
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        """The method name, with its swept parameters when there are any: ``cis (threshold=2)``."""
        if not self.params:
            return self.method
        return f"{self.method} ({', '.join(f'{k}={_show(v)}' for k, v in self.params)})"

    def backend_params(self) -> dict[str, Any]:
        return {**dict(self.params), **({} if self.density is None else {"density": self.density})}

    def to_json(self) -> list[Any]:
        return [self.method, self.density, dict(self.params)]


def _show(v: Any) -> str:
    return format(v, "g") if isinstance(v, float) else str(v).lower() if isinstance(v, bool) else str(v)


def parse_value(text: str) -> Any:
    """``true``/``false``/``none``, an int, a float, a JSON list as a tuple (``[]``, ``[0, 1]``: hashable, so
    it can be swept), else the string itself."""
    low = text.strip().lower()
    if low.startswith("["):
        try:
            got = json.loads(low)
        except ValueError:
            raise ValueError(f"{text.strip()!r} is not a JSON list") from None
        if not isinstance(got, list) or any(isinstance(x, (list, dict)) for x in got):
            raise ValueError(f"{text.strip()!r}: a list of plain values is expected")
        return tuple(got)
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


def _split_values(text: str) -> list[str]:
    """``"[],[0, 1],3"`` -> ``["[]", "[0, 1]", "3"]``: commas inside brackets belong to a list value."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return out


def parse_method_params(specs: Sequence[str]) -> tuple[ParamSweep, ...]:
    """``["specattn:top_p=0.95,0.97", "cis:threshold=0.8,2"]`` -> ((method, key, values), ...).
    Raises ValueError with a one-line reason on a malformed spec or a key given twice for one method."""
    out: list[ParamSweep] = []
    seen: set[tuple[str, str]] = set()
    for spec in specs:
        method, sep, rest = spec.partition(":")
        key, eq, values = rest.partition("=")
        method, key = method.strip(), key.strip()
        vals = [v for v in _split_values(values) if v.strip()]
        if not (sep and eq and method and key and vals):
            raise ValueError(f"--method-params {spec!r}: expected METHOD:KEY=VALUE[,VALUE...]")
        if key == "density":
            raise ValueError(f"--method-params {spec!r}: sweep density with --densities")
        if (method, key) in seen:
            raise ValueError(f"--method-params: {method}:{key} is given twice")
        seen.add((method, key))
        out.append((method, key, tuple(dict.fromkeys(parse_value(v) for v in vals))))
    return tuple(out)


def param_combinations(sweeps: Sequence[ParamSweep], method: str) -> list[tuple[tuple[str, Any], ...]]:
    """Every combination of ``method``'s swept values (``[()]`` when none is swept), in the order given."""
    mine = [(key, values) for m, key, values in sweeps if m == method]
    return [tuple(zip([k for k, _ in mine], combo, strict=True))
            for combo in itertools.product(*(values for _, values in mine))]


def plan_settings(methods: Sequence[str], densities: Sequence[float], sweeps: Sequence[ParamSweep],
                  takes_density: Callable[[str], bool]) -> list[Setting]:
    """Dense once, then each method x its parameter combinations x (each density, or none)."""
    out = [Setting("dense")]
    for m in dict.fromkeys(methods):
        if m == "dense":
            continue
        dens: list[float | None] = list(dict.fromkeys(densities)) if takes_density(m) else [None]
        out += [Setting(m, d, combo) for combo in param_combinations(sweeps, m) for d in dens]
    return out


def backend_takes_density(backend: AttentionBackend) -> bool:
    """Whether ``--density`` sets this backend's budget (see the module docstring)."""
    return backend.takes_density()
