"""Every registered method runs through the generator (prefill + decode, ragged batch) on a tiny model."""

from __future__ import annotations

import pytest
import torch
from helpers import fresh_cache, random_state, tiny_hf_config

from raysparse.attention import DenseAttention
from raysparse.config import ModelConfig
from raysparse.generate import FinishEvent, GenerationRequest, Generator
from raysparse.loader import model_from_state
from raysparse.methods.registry import check_params, create_backend, get_method, method_names, method_params
from raysparse.sampling import SamplingParams

# Methods whose generation loop is not the plain generator (speculative decoding).
SPECIAL = {"specattn"}


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_hf_config(layers=8)
    model = model_from_state(cfg, random_state(cfg).state_dict())
    prompts = [tuple(torch.randint(0, cfg.vocab_size, (n,)).tolist()) for n in (300, 130)]
    return model, prompts


def _generate(model, backend, prompts):
    gen = Generator(model, fresh_cache(model, 2048, page_size=64), backend)
    reqs = [GenerationRequest(p, SamplingParams(6, ignore_eos=True), str(i)) for i, p in enumerate(prompts)]
    return {e.request_id: e.token_ids for e in gen.generate(reqs) if isinstance(e, FinishEvent)}


def test_registry_holds_the_named_methods():
    names = set(method_names())
    assert {"dense", "streaming", "quest", "oracle", "sketch_walk", "delta", "socket", "socket_hard",
            "cis", "psaw", "etf", "cpe"} <= names
    with pytest.raises(ValueError, match="unknown attention method"):
        get_method("nope")


@pytest.mark.parametrize("name", [n for n in method_names() if n not in SPECIAL])
def test_every_method_generates_and_reports_density(tiny, name):
    model, prompts = tiny
    budget = get_method(name).takes_density
    # 0.4 of the whole model: 0.2 at each of the 6 sparse layers of 8 (layers 0 and 1 dense)
    backend = create_backend(name, model.cfg, **({"density": 0.4} if budget else {}))
    out = _generate(model, backend, prompts)
    assert sorted(out) == ["0", "1"] and all(len(t) == 6 for t in out.values())
    density = backend.meter.overall()
    assert 0.0 < density <= 1.0
    if budget:
        assert density < 1.0, f"{name} attended everything at density 0.4"


def test_unknown_method_parameter_is_refused(tiny):
    model, _ = tiny
    with pytest.raises(ValueError):
        create_backend("sketch_walk", model.cfg, nonsense=3)


def test_parameters_a_method_does_not_take_are_refused(tiny):
    """--density with dense (or SpecAttn, whose budget is top_p) is an error, not silently ignored; every
    command checks with ``check_params`` before anything loads, and the factory refuses the same."""
    model, prompts = tiny
    assert method_params("dense") == frozenset()
    # psaw and etf have a density field (CIS's budget, in the shared PrHS config) but no density budget
    assert {"dense_layers", "block_size", "phi"} <= method_params("psaw") and "density" not in method_params("psaw")
    assert "density" not in method_params("specattn") and "top_p" in method_params("specattn")
    assert sorted(n for n in method_names() if not get_method(n).takes_density) == ["dense", "etf", "psaw",
                                                                                     "specattn"]
    for name, params in (("dense", {"density": 0.3}), ("dense", {"dense_layers": (0,)}),
                         ("specattn", {"density": 0.3}), ("psaw", {"density": 0.3}), ("psaw", {"bogus": 1})):
        key = next(iter(params))
        refusal = "no density budget" if key == "density" else f"method '{name}' has no parameter '{key}'"
        with pytest.raises(ValueError, match=refusal):
            check_params(name, params)
        with pytest.raises(ValueError, match=refusal.split(" '")[0] if key != "density" else refusal):
            create_backend(name, model.cfg, **params)
    check_params("cis", {"density": 0.1, "sink": 4})
    with pytest.raises(ValueError, match="unknown attention method"):
        check_params("nope", {})
    assert _generate(model, create_backend("dense", model.cfg), prompts) == _generate(
        model, DenseAttention(model.cfg.num_layers), prompts)


def test_density_meter_reports_prefill_and_decode_apart():
    """The meter's prefill and decode figures against plain sums of random calls."""
    from raysparse.attention import DensityMeter

    seed = int(torch.randint(0, 2**31 - 1, ()))
    print(f"meter seed {seed}")
    g = torch.Generator().manual_seed(seed)
    meter = DensityMeter(3)
    sums = {True: [0.0, 0.0], False: [0.0, 0.0]}
    assert meter.prefill_overall() is None and meter.decode_overall() is None
    for _ in range(50):
        decode = bool(torch.rand((), generator=g) < 0.5)
        causal = float(torch.randint(1, 1000, (), generator=g))
        attended = causal * float(torch.rand((), generator=g))
        meter.add(int(torch.randint(0, 3, (), generator=g)), attended, causal, decode=decode)
        sums[decode][0] += attended
        sums[decode][1] += causal
    assert meter.prefill_overall() == pytest.approx(sums[False][0] / sums[False][1])
    assert meter.decode_overall() == pytest.approx(sums[True][0] / sums[True][1])
    assert meter.overall() == pytest.approx((sums[False][0] + sums[True][0]) / (sums[False][1] + sums[True][1]))


@pytest.mark.parametrize("name, params", [("streaming", {"density": 0.1}), ("quest", {"density": 0.1}),
                                          ("socket", {"density": 0.1}), ("delta", {"density": 0.1}),
                                          ("psaw", {}), ("etf", {})])
def test_replayed_decode_meters_each_layer_as_its_own_count(name, params):
    """A replayed step's meter counts once per class of layer (``decode_layer_class``): every layer's figures
    must equal the plain per-layer sum of ``decode_keys`` over random lengths (30 layers: PSAW's window narrows
    over several of them)."""
    cfg = ModelConfig.from_hf(tiny_hf_config(layers=30))
    seed = int(torch.randint(0, 2**31 - 1, ()))
    print(f"meter seed {seed}")
    g = torch.Generator().manual_seed(seed)
    b = create_backend(name, cfg, **params)
    lens = torch.randint(1, 5000, (int(torch.randint(1, 70, (), generator=g)),), generator=g).tolist()
    b.account_graph_decode(lens, 3)
    for layer in range(cfg.num_layers):
        want = sum(n if b.dense_decode_layer(layer) else b.decode_keys(layer, n) for n in lens) * 3
        assert b.meter.attended[layer] == want, (layer, b.meter.attended[layer], want)
        assert b.meter.causal[layer] == sum(lens) * 3
