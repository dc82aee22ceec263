"""The one registry of attention methods: every command's ``--method`` resolves here.

Besides its factory a method declares what the runtime must do differently for it (``MethodCapabilities``):
the scheduler and the engine read these by the method's name, so no generic code names a method. A
``SparseMethod`` gets its entry from ``method_spec``: its parameters are its config's fields.
"""

from __future__ import annotations

import json
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from functools import cache
from typing import TYPE_CHECKING, Any, Union

from raysparse.attention import AttentionBackend, DenseAttention
from raysparse.config import ModelConfig
from raysparse.methods.budget import layer_density

if TYPE_CHECKING:  # annotations only: the methods import this module
    from raysparse.methods.base import MethodConfig, SparseMethod


@dataclass(frozen=True)
class MethodCapabilities:
    """How a method runs in the engine; the defaults fit every method that decodes one token per step.

    - ``needs_draft``: decode steps are draft-then-verify rounds, so the engine needs its draft actor.
    - ``greedy_only``: the method decodes greedily only (temperature 0).
    - ``engine_greedy_only``: the engine's shard rounds of the method accept greedily only, although the
      method itself samples (in-process, e.g. ``SpecAttnGenerator``'s speculative-sampling rule).
    - ``chunked_prefill``: a prompt may be prefilled over several steps (a method whose draft prefills
      whole prompts may not).
    - ``multi_step_decode``: several decode steps may run in one call to the shards (``--decode-steps``);
      not for a method whose decode step is a round of its own.
    - ``prefix_cache``: a prompt may start from cached pages of an earlier prompt with the same prefix (the
      method's state of those pages is per page, or the method rebuilds its per-sequence part from them);
      a method whose prefix state cannot be reused recomputes the whole prompt (``SparseMethod.prefix_state``
      says which kind of state a method has, and why).
    - ``mixed_steps``: running sequences' decode tokens may ride in a prefill step as one-token rows (a mixed
      step, as vLLM's scheduler builds them): the method's prefill of a one-token row is its decode of that
      token. Its decodes then advance at every prefill step instead of waiting for a step of their own.
    """

    needs_draft: bool = False
    greedy_only: bool = False
    engine_greedy_only: bool = False
    chunked_prefill: bool = True
    multi_step_decode: bool = True
    prefix_cache: bool = True
    mixed_steps: bool = False


@dataclass(frozen=True)
class MethodSpec:
    """A method's registry entry. ``params`` names every parameter the method takes (its config's fields,
    ``method_spec``); anything else - ``--density`` for a method without a budget included - is refused, by
    ``check_params`` before anything loads and by the factory."""

    name: str
    description: str
    factory: Callable[..., AttentionBackend]  # (model config, **method params) -> backend
    capabilities: MethodCapabilities = MethodCapabilities()
    params: frozenset[str] = frozenset()
    config_cls: type | None = None  # the config whose field types the parameters' values must have

    @property
    def takes_density(self) -> bool:
        """Whether ``--density`` sets a budget of this method."""
        return "density" in self.params


def no_density_error(name: str) -> str:
    """The one-line refusal of ``--density`` by a method without a density budget."""
    return (f"method {name!r} has no parameter 'density': it has no density budget, so --density does not apply "
            "to it (its real prefill and decode densities are reported)")


def budgeted_config(cls: type[SparseMethod], model_cfg: ModelConfig, config: MethodConfig) -> MethodConfig:
    """``config`` with its whole-model ``density`` turned into a sparse layer's (``layer_density``, the layers
    the method leaves dense counted: its ``dense_layers`` and any it never selects in) and the asked density
    kept as ``target_density``. Unchanged for a method or config without a density budget."""
    density = getattr(config, "density", None)
    if density is None:
        return config
    probe = cls(model_cfg, config)
    if not probe.has_density_budget():
        return config
    dense = [i for i in range(model_cfg.num_layers) if probe.is_dense_layer(i)]
    return replace(config, density=layer_density(density, model_cfg.num_layers, dense), target_density=density)


def method_spec(cls: type[SparseMethod], description: str) -> MethodSpec:
    """A registry entry for ``cls``: its parameters are its config's fields, and any other one - a shared flag
    such as ``--density`` included, for a method whose config has no such field - is an error. A method whose
    config has a density field but no density budget (``density_budget = False``: PSAW's and ETF's budget is
    their depth schedule) does not take ``density`` either."""
    fields = frozenset(cls.config_cls.__dataclass_fields__) - {"target_density"}
    if getattr(cls, "density_budget", True) is False:
        fields = fields - {"density"}

    def factory(model_cfg: ModelConfig, **params: Any) -> AttentionBackend:
        if "density" in params and "density" not in fields:
            raise ValueError(no_density_error(cls.name))
        unknown = set(params) - fields
        if unknown:
            raise ValueError(f"method {cls.name!r} has no parameter(s) {sorted(unknown)}; it takes {sorted(fields)}")
        if "density" in fields and "dense_layers" in fields and "dense_layers" not in params:
            # A whole-model density is spread over every layer: two dense layers (the paper's) would take 2/30 of the
            # model's pairs and starve the rest (at 0.10 each sparse layer kept 3.6% of its keys), and every
            # method measured kept more of dense's accuracy with every layer sparse (BENCHMARKS.md, "Every
            # layer sparse"). ``dense_layers=[0, 1]`` asks for the paper's.
            params = {**params, "dense_layers": ()}
        return cls(model_cfg, budgeted_config(cls, model_cfg, cls.config_cls(**params)))

    return MethodSpec(cls.name, description, factory, params=fields, config_cls=cls.config_cls,
                      capabilities=MethodCapabilities(prefix_cache=cls.prefix_state != "none"))


_REGISTRY: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"attention method {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


# Modules that register built-in methods when imported; loaded on first lookup to avoid import cycles.
BUILTIN_MODULES: list[str] = [
    "raysparse.methods.baselines",
    "raysparse.methods.quest",
    "raysparse.methods.delta",
    "raysparse.methods.socket",
    "raysparse.methods.sketch_walk",
    "raysparse.methods.prhs",
    "raysparse.specattn.method",
]


def _load_builtins() -> None:
    import importlib

    for mod in BUILTIN_MODULES:
        importlib.import_module(mod)


def method_names() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def get_method(name: str) -> MethodSpec:
    _load_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown attention method {name!r}; choose one of: {', '.join(method_names())}") from None


def method_capabilities(name: str) -> MethodCapabilities:
    """What the runtime must do for method ``name`` (raises ValueError for an unknown one)."""
    return get_method(name).capabilities


def method_params(name: str) -> frozenset[str]:
    """The parameters method ``name`` takes (raises ValueError for an unknown method)."""
    return get_method(name).params


def check_params(name: str, params: Iterable[str]) -> None:
    """Raises ValueError, naming the first one, when ``params`` holds a parameter that method ``name`` does not
    take. Needs no model: every command checks its method flags with it before anything loads."""
    spec = get_method(name)
    for key in params:
        if key == "density" and key not in spec.params:
            raise ValueError(no_density_error(name))
        if key not in spec.params:
            takes = f"it takes {', '.join(sorted(spec.params))}" if spec.params else "it takes none"
            raise ValueError(f"method {name!r} has no parameter {key!r}; {takes}")


@cache
def _field_types(config_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(config_cls)


def _spell(value: Any) -> str:
    """A value as a client wrote it (JSON: ``true``, ``null``, ``"0.1"``), for a one-line refusal."""
    try:
        return json.dumps(list(value) if isinstance(value, tuple) else value)
    except (TypeError, ValueError):
        return repr(value)


_PLURALS = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}


def _type_error(kind: Any, value: Any) -> str | None:
    """What is wrong with ``value`` for a field of type ``kind`` (None: nothing). A bool is not a number
    (Python's bool is an int, and a config would take ``true`` as 1), and a float field takes integers."""
    if kind is Any:
        return None
    if kind is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "must be a number"
        return None if math.isfinite(value) else "must be a finite number"
    if kind is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "must be an integer"
    if kind is str:
        return None if isinstance(value, str) else "must be a string"
    if typing.get_origin(kind) is tuple:  # tuple[int, ...]: a list of the element type
        if not isinstance(value, (tuple, list)):
            return "must be a list"
        elem = (typing.get_args(kind) or (Any,))[0]
        if any(_type_error(elem, v) is not None for v in value):
            return f"must be a list of {_PLURALS.get(elem, 'values of its type')}"
        return None
    return None  # a type this check does not know: the config's own checks decide


def check_param_values(name: str, params: Mapping[str, Any]) -> None:
    """Raises ValueError, in one line naming the parameter, when a value of ``params`` does not have its config
    field's type: null is not a value (leave the parameter out for its default), a bool is not a number, a
    string or a list is not a number. The engine checks every request's parameters with it before it is queued,
    so a value that a config would coerce (``true`` as 1) or fail on later (``null`` in arithmetic) is refused."""
    check_params(name, params)
    spec = get_method(name)
    types_of = _field_types(spec.config_cls) if spec.config_cls is not None else {}
    for key, value in params.items():
        if value is None:
            raise ValueError(f"method {name!r} parameter {key!r} is null: give it a value or leave it out")
        kind = types_of.get(key, Any)
        if typing.get_origin(kind) in (Union, types.UnionType):  # ``int | None``: None is refused above
            options = [a for a in typing.get_args(kind) if a is not type(None)]
            kind = options[0] if len(options) == 1 else Any
        err = _type_error(kind, value)
        if err is not None:
            raise ValueError(f"method {name!r} parameter {key!r} {err}, got {_spell(value)}")


def create_backend(name: str, cfg: ModelConfig, **params: Any) -> AttentionBackend:
    check_params(name, params)
    return get_method(name).factory(cfg, **params)


def _dense(cfg: ModelConfig, **params: Any) -> AttentionBackend:
    check_params("dense", params)
    return DenseAttention(cfg.num_layers)


register(MethodSpec("dense", "exact causal attention (SDPA)", _dense,
                    capabilities=MethodCapabilities(mixed_steps=True)))
