"""The OpenAI-compatible HTTP API: `raysparse serve --http-port` in a real process, talked to with the official
`openai` client, beside the gRPC API of the same process (a tiny random Llama with a chat template, CPU)."""

from __future__ import annotations

import re
import signal
import threading
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from serving_helpers import reference_logprobs, serve_process, wait_kv_free  # noqa: E402

MAX_POS = 1024
KV_TOKENS = 768  # below the model's positions, so a request can fit the context but not the cache
SPARSE = {"method": "streaming", "density": 0.25, "sink_tokens": 16, "block_size": 16, "dense_layers": []}
# A prompt of a few blocks is all sink and diagonal blocks, which no density below 1 leaves room for: short
# prompts ask for the sparse method at density 1 (the method's path, nothing left out).
SHORT = {**SPARSE, "density": 1.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from raysparse.serving.tiny import CHAT_TEMPLATE, write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("m") / "tiny", max_positions=MAX_POS, chat_template=CHAT_TEMPLATE)
    with serve_process(model, "--kv-cache-tokens", str(KV_TOKENS)) as served:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.http_port}/v1", api_key="unused", max_retries=0,
                               timeout=60)
        try:
            yield {"proc": served.proc, "grpc": served.grpc, "client": client, "model": model,
                   "http": f"http://127.0.0.1:{served.http_port}",
                   "metrics": f"http://127.0.0.1:{served.metrics_port}/metrics"}
        finally:
            client.close()


def _metrics(url: str) -> dict[str, float]:
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_models_list(server):
    models = server["client"].models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].owned_by == "raysparse"
    assert server["client"].models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        server["client"].models.retrieve("no-such-model")


def test_completion_equals_the_grpc_api(server):
    c, g = server["client"], server["grpc"]
    ref = g.generate(text="The quick brown fox", max_new_tokens=8, ignore_eos=True, timeout=60)
    out = c.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=0,
                               extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len("The quick brown fox") and out.usage.completion_tokens == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8
    ext = out.raysparse  # our extension field: the method and the request's measured density
    assert ext["method"] == "dense" and ext["density"]["prefill"] == 1.0 and ext["density"]["decode"] == 1.0
    # token ids as the prompt, and a default max_tokens of 16 (OpenAI's)
    by_ids = c.completions.create(model="tiny", prompt=[40, 41, 42, 43], temperature=0,
                                  extra_body={"ignore_eos": True})
    ref_ids = g.generate(token_ids=[40, 41, 42, 43], max_new_tokens=16, ignore_eos=True, timeout=60)
    assert by_ids.choices[0].text == ref_ids.text and by_ids.usage.completion_tokens == 16


def test_streamed_chat_equals_the_grpc_greedy_output(server):
    c, g = server["client"], server["grpc"]
    question = "What is the capital of France?"
    # Tokens already queued when the stream's handler reads come in one chunk (as vLLM's do), so a short answer
    # on a loaded machine can arrive whole: 64 tokens take many engine steps, and some chunk boundary among them.
    n = 64
    ref = g.generate(text=question, chat=True, max_new_tokens=n, ignore_eos=True, timeout=60)
    assert len(ref.token_ids) == n
    stream = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}], max_tokens=n,
                                       temperature=0, stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [ch.choices[0].delta.content for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(content) >= 2  # it streamed
    assert "".join(content) == ref.text
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert chunks[-1].usage.prompt_tokens == ref.prompt_tokens
    assert len({ch.id for ch in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    # the same without streaming
    whole = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}], max_tokens=n,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == ref.text and whole.choices[0].message.role == "assistant"


def test_per_request_method_and_its_density(server):
    c = server["client"]
    prompt = list(range(5, 100)) * 3  # 285 tokens: streaming keeps a few 16-token blocks per row
    out = c.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                               extra_body={"ignore_eos": True, "raysparse": SPARSE})
    ext = out.raysparse
    assert ext["method"] == "streaming" and ext["method_params"]["density"] == 0.25
    # the density asked for is the density attended, prefill and decode each (every layer and KV head)
    assert ext["density"]["prefill"] == pytest.approx(0.25, abs=0.01)
    assert ext["density"]["decode"] == pytest.approx(0.25, abs=0.01)
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # OpenAI's field; nothing came from a cache
    # a prompt too short for its density is served at the density its forced blocks have, and says so
    short = c.completions.create(model="tiny", prompt=prompt[:40], max_tokens=2, temperature=0,
                                 extra_body={"ignore_eos": True, "raysparse": SPARSE})
    assert short.raysparse["density"]["prefill"] > 0.25
    dense = c.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert dense.raysparse["density"] == {"prefill": 1.0, "decode": 1.0}
    # the gRPC API's validation: unknown methods and bad parameters are 400s
    # a parameter's value must have its config field's type: a bool is not a number, null is not a value
    for ext_body in ({"method": "no_such_method"}, {"method": "streaming", "bogus": 1},
                     {"method": "streaming", "density": 2.0}, {"method": "quest", "density": True},
                     {"method": "quest", "density": None}, {"method": "quest", "density": "0.1"},
                     {"method": "quest", "density": [0.1]}, {"method": "quest", "params": {"page_size": True}},
                     {"method": "streaming", "sink_tokens": None}):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"raysparse": ext_body})
        assert e.value.status_code == 400 and e.value.body["message"], ext_body
        assert "\n" not in e.value.body["message"] and "Error" not in e.value.body["message"], e.value.body


def test_bad_requests_are_400_with_openai_error_bodies(server):
    c = server["client"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="hello", max_tokens=-1)
    assert e.value.status_code == 400
    assert e.value.body["param"] == "max_tokens" and e.value.body["type"] == "invalid_request_error"
    bad = [
        dict(prompt="", max_tokens=4),
        dict(prompt=" \t\n ", max_tokens=4),
        dict(prompt="hi", max_tokens=4, temperature=-1.0),
        dict(prompt="hi", max_tokens=4, top_p=1.5),
        dict(prompt="hi", max_tokens=4, n=0),
        dict(prompt="hi", max_tokens=4, n=17),
        dict(prompt="hi", max_tokens=4, n=2, stream=True),
        dict(prompt="hi", max_tokens=4, echo=True, stream=True),
        dict(prompt="hi", max_tokens=4, best_of=3),
        dict(prompt="hi", max_tokens=4, logprobs=21),
        dict(prompt="hi", max_tokens=4, logprobs=-1),
        dict(prompt="hi", max_tokens=0),  # 0 only with echo: the prompt scored
        dict(prompt="hi", max_tokens=4, presence_penalty=2.5),
        dict(prompt="hi", max_tokens=4, frequency_penalty=-3),
        dict(prompt=[3] * (MAX_POS - 10), max_tokens=20),  # past the model's positions
        dict(prompt=[10_000], max_tokens=4),  # outside the vocabulary
        dict(prompt=[3] * (KV_TOKENS - 8), max_tokens=40),  # can never fit a replica's KV cache
        dict(prompt="hi", max_tokens=4, stop=["a", "b", "c", "d", "e"]),
        dict(prompt="hi", max_tokens=4, extra_body={"raysparse": {"method": 7}}),
    ]
    for kwargs in bad:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny", **kwargs)
        assert e.value.status_code == 400, kwargs
        assert e.value.body["message"], kwargs
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    # not JSON at all, and a body without its required field
    for data in (b"{not json", b'{"model": "tiny"}'):
        req = urllib.request.Request(server["http"] + "/v1/completions", data=data,
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as he:
            urllib.request.urlopen(req, timeout=10)
        assert he.value.code == 400 and b'"error"' in he.value.read()
    ok = c.completions.create(model="tiny", prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 3  # still serving


def _assert_close(got, want, what, seed, tol=1e-4):
    assert got is not None and abs(got - want) <= tol, f"{what}: {got} != {want} (seed {seed})"


def _assert_top(got: dict, row, chosen: int, k: int, text_of, what: str, seed: int) -> None:
    """Completions' ``top_logprobs`` entry: the row's top k and the chosen token, keyed by text (tokens that
    spell the same text share a key, the chosen one's last, as the server writes them)."""
    import torch

    top_v, top_i = torch.topk(row, k)
    want = {**{text_of(int(i)): float(v) for i, v in zip(top_i, top_v, strict=True)},
            text_of(chosen): float(row[chosen])}
    assert set(got) == set(want), f"{what}: {sorted(got)} != {sorted(want)} (seed {seed})"
    for key, v in want.items():
        _assert_close(got[key], v, f"{what} alternative {key!r}", seed)


def test_prompt_and_token_logprobs_equal_a_transformers_forward(server):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs, max_tokens 0 or 1) and sampling clients'
    token logprobs: every element against the plain forward's log-softmax. A repeated prompt checks that the
    prefix cache, which would skip its cached rows, is not used for it (``test_engine`` splits a prompt over
    prefill chunks)."""
    import random

    import torch
    from transformers import AutoTokenizer

    c = server["client"]
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(server["model"])

    def text_of(i: int) -> str:
        return tokenizer.decode([i])

    for plen in (rng.randrange(2, 40), rng.randrange(150, 300)):
        ids = [rng.randrange(3, 98) for _ in range(plen)]
        ref = reference_logprobs(server["model"], ids)
        for max_tokens in (0, 1, 1):  # the second max_tokens=1 finds the same prompt already prefilled once
            out = c.completions.create(model="tiny", prompt=ids, max_tokens=max_tokens, echo=True, logprobs=3,
                                       temperature=0, extra_body={"ignore_eos": True})
            ch = out.choices[0]
            lp = ch.logprobs
            assert len(lp.token_logprobs) == plen + max_tokens, seed
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            for i in range(1, plen):
                _assert_close(lp.token_logprobs[i], float(ref[i - 1, ids[i]]), f"prompt token {i} of {plen}", seed)
                _assert_top(lp.top_logprobs[i], ref[i - 1], ids[i], 3, text_of, f"prompt token {i}", seed)
            assert out.usage.prompt_tokens_details.cached_tokens == 0, seed
            assert out.raysparse["prompt_logprobs"] == {"method": "dense", "prefill_density": 1.0}
            if max_tokens == 0:
                assert out.usage.completion_tokens == 0 and ch.text == _tiny_text(server["model"], ids)
                assert ch.finish_reason == "length"
            else:
                t = int(ref[-1].argmax())  # greedy: the sampled token is the argmax
                _assert_close(lp.token_logprobs[-1], float(ref[-1, t]), "the sampled token", seed)
    # generated tokens' logprobs with their top 4 alternatives, over several decode steps (chat: a list each)
    prompt = [rng.randrange(3, 98) for _ in range(rng.randrange(5, 60))]
    out = c.completions.create(model="tiny", prompt=prompt, max_tokens=6, logprobs=4, temperature=0,
                               extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 6
    g = server["grpc"].generate(token_ids=prompt, max_new_tokens=6, ignore_eos=True, timeout=60)
    ref = reference_logprobs(server["model"], prompt + list(g.token_ids))
    for j, tok in enumerate(g.token_ids):
        row = ref[len(prompt) - 1 + j]
        _assert_close(lp.token_logprobs[j], float(row[tok]), f"generated token {j}", seed)
        _assert_top(lp.top_logprobs[j], row, tok, 4, text_of, f"generated token {j}", seed)
    text = "".join(chr(rng.randrange(97, 123)) for _ in range(rng.randrange(3, 30)))
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=5,
                                     temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    g = server["grpc"].generate(text=text, chat=True, max_new_tokens=5, ignore_eos=True, timeout=60)
    chat_ids = _chat_prompt_ids(server["model"], text)
    ref = reference_logprobs(server["model"], chat_ids + list(g.token_ids))
    assert len(content) == 5
    for j, (entry, tok) in enumerate(zip(content, g.token_ids, strict=True)):
        row = ref[len(chat_ids) - 1 + j]
        _assert_close(entry.logprob, float(row[tok]), f"chat token {j}", seed)
        top = torch.topk(row, 3).values.tolist()
        assert len(entry.top_logprobs) == 3
        for k, alt in enumerate(entry.top_logprobs):
            _assert_close(alt.logprob, top[k], f"chat token {j} alternative {k}", seed)
    # a prefill-sparse method changes the prompt's logprobs, and the response says which method made them
    long_ids = [rng.randrange(3, 98) for _ in range(285)]
    sparse = c.completions.create(model="tiny", prompt=long_ids, max_tokens=0, echo=True, logprobs=1,
                                  extra_body={"raysparse": SPARSE})
    info = sparse.raysparse["prompt_logprobs"]
    assert info["method"] == "streaming" and info["prefill_density"] < 1.0
    wait_kv_free(server["grpc"])


def _chat_prompt_ids(model_dir, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False)
    return tok(rendered, add_special_tokens=False)["input_ids"]


def test_n_choices_share_the_prompt_and_are_seeded(server):
    import random

    c = server["client"]
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 98) for _ in range(150)]  # 150 tokens: 2 full pages of the default 64 tokens
    kw = dict(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=1234, n=4,
              extra_body={"ignore_eos": True})
    out = c.completions.create(**kw)
    assert [ch.index for ch in out.choices] == [0, 1, 2, 3]
    texts = [ch.text for ch in out.choices]
    assert len(set(texts)) > 1, seed  # each choice its own seed
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == 32
    # the prompt was prefilled once: the other three choices found its full pages in the prefix cache
    assert out.usage.prompt_tokens_details.cached_tokens == 3 * 128, (out.usage, seed)
    assert len(out.raysparse["request_ids"]) == 4 and out.id.startswith("cmpl-")
    again = c.completions.create(**kw)
    assert [ch.text for ch in again.choices] == texts  # seeded: the same four samples
    greedy = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       temperature=0, n=2, extra_body={"ignore_eos": True})
    assert len(greedy.choices) == 2 and greedy.choices[0].message.content == greedy.choices[1].message.content
    wait_kv_free(server["grpc"])


def test_presence_and_frequency_penalties_equal_the_rule_on_a_plain_forward(server):
    """OpenAI's rule: a token's logit less presence_penalty once it appeared in the output and frequency_penalty
    per appearance; greedy over the penalized logits of transformers' forward is the oracle."""
    import random

    import torch
    from transformers import LlamaForCausalLM

    c = server["client"]
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 98) for _ in range(rng.randrange(3, 20))]
    presence, frequency = rng.choice([0.0, 0.5, 1.5]), rng.choice([0.7, 2.0])
    out = c.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                               presence_penalty=presence, frequency_penalty=frequency, logprobs=0,
                               extra_body={"ignore_eos": True})
    model = LlamaForCausalLM.from_pretrained(server["model"], dtype=torch.float32).eval()
    ids, counts = list(prompt), {}
    with torch.no_grad():
        for _ in range(10):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            for t, n in counts.items():
                logits[t] -= presence + frequency * n
            t = int(logits.argmax())
            counts[t] = counts.get(t, 0) + 1
            ids.append(t)
    want = _tiny_text(server["model"], ids[len(prompt):], skip_special=True)  # as the streamed text leaves them
    assert out.choices[0].text == want, f"seed {seed}: presence {presence}, frequency {frequency}"
    wait_kv_free(server["grpc"])


def _tiny_text(model_dir, ids: list[int], skip_special: bool = False) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).decode(ids, skip_special_tokens=skip_special)


def _post(url: str, body: dict) -> tuple[int, dict]:
    import json

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_detokenize_version_and_streamed_logprobs(server):
    import json

    c, http = server["client"], server["http"]
    status, tok = _post(http + "/tokenize", {"prompt": "abc"})
    assert status == 200 and tok == {"count": 3, "max_model_len": MAX_POS, "tokens": [12, 13, 14]}
    status, chat = _post(http + "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and chat["count"] == len("user: hi\nassistant: ")
    assert _post(http + "/detokenize", {"tokens": [12, 13, 14]}) == (200, {"prompt": "abc"})
    assert _post(http + "/detokenize", {"tokens": [10_000]})[0] == 400
    assert _post(http + "/tokenize", {})[0] == 400
    with urllib.request.urlopen(http + "/version", timeout=10) as r:
        assert json.loads(r.read())["version"]
    # a stream's chunks carry their tokens' logprobs: together, the same as the whole response's
    kw = dict(model="tiny", messages=[{"role": "user", "content": "stream me"}], max_tokens=6, temperature=0,
              logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole = c.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [e for ch in c.chat.completions.create(stream=True, **kw)
                for e in ((ch.choices[0].logprobs.content or []) if ch.choices and ch.choices[0].logprobs else [])]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in whole]
    assert len(whole) == 6 and all(len(e.top_logprobs) == 2 for e in streamed)


def test_stop_strings(server):
    c = server["client"]
    full = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=24, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    assert len(full) >= 10
    stop = full[6:8]
    cut = full[:full.index(stop)]
    stops = 'raysparse:request_success_total{finished_reason="stop",model_name="tiny"}'
    before = _metrics(server["metrics"]).get(stops, 0.0)
    out = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=24, temperature=0, stop=[stop],
                               extra_body={"ignore_eos": True})
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=24, temperature=0, stop=stop,
                                    stream=True, extra_body={"ignore_eos": True})
    chunks = list(streamed)
    assert "".join(ch.choices[0].text for ch in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_kv_free(server["grpc"])
    assert _metrics(server["metrics"])[stops] == before + 2  # counted as stops, though the engine aborted them


def test_client_disconnect_mid_stream_frees_the_kv(server):
    c, g = server["client"], server["grpc"]
    wait_kv_free(g)
    aborts = 'raysparse:request_success_total{finished_reason="abort",model_name="tiny"}'
    before = _metrics(server["metrics"]).get(aborts, 0.0)
    stream = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Tell me a long story"}],
                                       max_tokens=KV_TOKENS - 64, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    it = iter(stream)
    got = [next(it) for _ in range(3)]
    assert got[0].choices[0].delta.role == "assistant"
    busy = g.server_info()
    assert busy.running == 1 and busy.kv_used_tokens >= KV_TOKENS - 64
    m = _metrics(server["metrics"])
    assert m['raysparse:num_requests_running{model_name="tiny"}'] == 1.0
    assert m['raysparse:kv_cache_usage_perc{model_name="tiny"}'] >= (KV_TOKENS - 64) / KV_TOKENS
    stream.close()  # the client goes away mid-stream
    wait_kv_free(g)
    after = _metrics(server["metrics"])
    assert after[aborts] == before + 1
    assert after['raysparse:kv_cache_usage_perc{model_name="tiny"}'] == 0.0
    # a non-streaming request whose client times out is aborted too
    # far shorter than the request (hundreds of tokens, four decode steps a call): the client gives up first
    slow = openai.OpenAI(base_url=server["http"] + "/v1", api_key="x", max_retries=0, timeout=0.2)
    with pytest.raises(openai.APITimeoutError):
        slow.completions.create(model="tiny", prompt="a long wait", max_tokens=KV_TOKENS - 64,
                                extra_body={"ignore_eos": True})
    slow.close()
    wait_kv_free(g, timeout=20)


def test_concurrent_streams_match_sequential_greedy(server):
    c = server["client"]
    prompts = [[(7 * i + j) % 90 + 5 for j in range(3 + 5 * i)] for i in range(8)]
    sequential = [c.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
    results: list = [None] * len(prompts)

    def one(i: int) -> None:
        s = c.completions.create(model="tiny", prompt=prompts[i], max_tokens=8, temperature=0, stream=True,
                                 extra_body={"ignore_eos": True})
        results[i] = "".join(ch.choices[0].text for ch in s)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == sequential


def test_bench_load_generator_on_the_http_api(server):
    """The bench's OpenAI backends against this server: vLLM bench serve's request and timing."""
    from transformers import AutoTokenizer

    from raysparse.bench.loadgen import LoadConfig, run_load

    tok = AutoTokenizer.from_pretrained(server["model"])
    prompts = [list(range(5 + i, 45 + i)) for i in range(4)]
    for backend in ("openai", "openai-chat"):
        cfg = LoadConfig(num_prompts=4, output_len=5, max_concurrency=2, backend=backend, method="streaming",
                         method_params=tuple(sorted({k: v for k, v in SHORT.items() if k != "method"}.items())))
        metrics, records = run_load(server["http"], prompts, cfg, decode=lambda ids: tok.decode(ids))
        assert metrics["completed"] == 4 and metrics["failed"] == 0, [r.error for r in records]
        assert metrics["total_output_tokens"] == 20
        assert metrics["mean_density_prefill"] == 1.0 and metrics["mean_density_decode"] == 1.0  # as asked
        assert all(r.chunk_times and r.ttft > 0 and r.t_end >= r.chunk_times[-1] for r in records)
    bad = LoadConfig(num_prompts=1, output_len=5, backend="openai", method="no_such_method")
    metrics, records = run_load(server["http"] + "/v1", prompts[:1], bad)
    assert metrics["failed"] == 1 and records[0].error.startswith("HTTP 400")


def test_metrics_follow_vllm_names(server):
    c = server["client"]
    url = server["metrics"]
    before = _metrics(url)
    lab = '{model_name="tiny"}'

    def val(m: dict, name: str) -> float:
        return m.get(name, 0.0)

    def delta(name: str) -> float:
        return val(after, name) - val(before, name)

    n_req, n_tok = 3, 5
    for _ in range(n_req):
        c.completions.create(model="tiny", prompt="abcdefg", max_tokens=n_tok, temperature=0,
                             extra_body={"ignore_eos": True, "raysparse": SHORT})
    after = _metrics(url)
    assert delta(f"raysparse:generation_tokens_total{lab}") == n_req * n_tok
    assert delta(f"raysparse:prompt_tokens_total{lab}") == n_req * 7
    assert delta('raysparse:request_success_total{finished_reason="length",model_name="tiny"}') == n_req
    for hist, per_req in (("time_to_first_token_seconds", 1), ("e2e_request_latency_seconds", 1),
                          ("inter_token_latency_seconds", n_tok - 1)):
        cnt = f"raysparse:{hist}_count{lab}"
        assert delta(cnt) == n_req * per_req, hist
        assert delta(f"raysparse:{hist}_sum{lab}") > 0
        assert after[f'raysparse:{hist}_bucket{{le="+Inf",model_name="tiny"}}'] == after[cnt]
    dens = 'raysparse:attention_density_count{method="streaming",model_name="tiny",phase="prefill"}'
    assert delta(dens) == n_req
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"raysparse:{gauge}{lab}" in after
    # the same registry on the HTTP port, as vLLM serves it
    http = _metrics(server["http"] + "/metrics")
    assert http[f"raysparse:generation_tokens_total{lab}"] >= after[f"raysparse:generation_tokens_total{lab}"]


def test_sigterm_stops_both_apis(server):
    """Last in the module: SIGTERM drains, exits 0, and the HTTP port is closed."""
    proc = server["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    log = proc.stdout.read() if proc.stdout else ""
    assert re.search(r"OpenAI API on http://127\.0\.0\.1:\d+/v1", log) and "draining" in log
    with pytest.raises(openai.APIConnectionError):
        server["client"].models.list()


def test_unavailable_while_the_engine_is_not_ready():
    from raysparse.orchestration.engine import Engine, EngineConfig
    from raysparse.serving.server import InferenceServer, ServerConfig

    eng = Engine(EngineConfig())
    eng.state = "loading"  # as while a replica loads its weights (nothing is started here)
    srv = InferenceServer(eng, ServerConfig(port=0, metrics_port=None, http_port=0)).start()
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key="x", max_retries=0, timeout=10)
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model="x", prompt="hi", max_tokens=2)
        assert e.value.status_code == 503 and e.value.body["type"] == "service_unavailable_error"
        with pytest.raises(urllib.error.HTTPError) as he:
            urllib.request.urlopen(f"http://127.0.0.1:{srv.http_port}/health", timeout=10)
        assert he.value.code == 503
        c.close()
    finally:
        srv.stop(shutdown_engine=False)


def test_stop_string_matcher():
    from raysparse.serving.openai_responses import StopStrings

    s = StopStrings(["END", "xy"])
    out = [s.feed(d) for d in ("ab", "cE", "N", "x", "q", "EN", "D")]
    assert "".join(out) == "abcENxq" and s.stopped and s.text == "abcENxq"
    assert out[1:4] == ["c", "", "EN"]  # "E", then "EN", then "x" held back until decided
    t = StopStrings([])
    assert [t.feed(d) for d in ("a", "b")] == ["a", "b"]


def test_engine_errors_map_to_openai_statuses():
    """The engine's typed errors (the gRPC status codes) as HTTP statuses with OpenAI-style bodies."""
    from raysparse.orchestration.engine_api import (
        CapacityExceededError,
        DuplicateRequestError,
        EngineUnavailableError,
        InvalidRequestError,
        RequestTooLargeError,
    )
    from raysparse.serving.openai_schema import engine_error

    cases = [(InvalidRequestError("bad"), 400, "invalid_request_error"),
             (RequestTooLargeError("never fits"), 400, "invalid_request_error"),
             (CapacityExceededError("4096 requests are already waiting"), 429, "rate_limit_error"),
             (EngineUnavailableError("the engine is draining"), 503, "service_unavailable_error"),
             (DuplicateRequestError("dup"), 409, "server_error"),
             (ValueError("temperature"), 400, "invalid_request_error")]
    for err, status, kind in cases:
        e = engine_error(err)
        assert (e.status, e.body()["error"]["type"]) == (status, kind), err
        assert e.body()["error"]["message"] == str(err)
    assert RequestTooLargeError.code == "RESOURCE_EXHAUSTED"  # the gRPC API answers as before
