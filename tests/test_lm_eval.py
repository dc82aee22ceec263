"""lm-evaluation-harness against `raysparse serve --http-port`: its `local-completions` model runs a loglikelihood
task and a generate_until task defined here (a task directory and a local JSON file, nothing downloaded) on the
tiny random Llama, and every loglikelihood it reports is the plain forward's (transformers) within 1e-4."""

from __future__ import annotations

import json

import pytest

lm_eval = pytest.importorskip("lm_eval")

from serving_helpers import reference_logprobs, serve_process  # noqa: E402

MAX_POS = 1024
CHOICE_DOCS = [
    {"question": "The sky is", "choices": ["blue", "green", "loud"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
    {"question": "Grass is", "choices": ["purple", "green", "square"], "answer": 1},
    {"question": "Fire is", "choices": ["cold", "hot"], "answer": 1},
]
GEN_DOCS = [{"prompt": "Say a word:", "target": "word"}, {"prompt": "Count: 1 2 3", "target": " 4"},
            {"prompt": "Colour of snow?", "target": "white"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from raysparse.serving.tiny import write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("m") / "tiny", max_positions=MAX_POS)
    with serve_process(model) as served:
        yield {"url": f"http://127.0.0.1:{served.http_port}/v1", "model": model}


def _write_tasks(root) -> None:
    """A multiple-choice (loglikelihood) task and a generate_until task, each over a local JSON file."""
    for name, docs in (("choice", CHOICE_DOCS), ("gen", GEN_DOCS)):
        (root / f"{name}.json").write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"
    (root / "rs_choice.yaml").write_text(
        "task: rs_choice\n" + common.format(path=root / "choice.json")
        + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
          "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    (root / "rs_gen.yaml").write_text(
        "task: rs_gen\n" + common.format(path=root / "gen.json")
        + "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
          "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
          "metric_list:\n  - metric: exact_match\n")


def test_lm_eval_local_completions_on_local_tasks(server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    _write_tasks(task_dir)
    lm = LocalCompletionsAPI(model="tiny", base_url=f"{server['url']}/completions", tokenizer=str(server["model"]),
                             tokenizer_backend="huggingface", num_concurrent=1, max_retries=1, max_length=MAX_POS)
    out = simple_evaluate(model=lm, tasks=["rs_choice", "rs_gen"], task_manager=TaskManager(include_path=str(task_dir)),
                          log_samples=True, bootstrap_iters=0)
    results = out["results"]
    assert 0.0 <= results["rs_choice"]["acc,none"] <= 1.0, results
    assert 0.0 <= results["rs_gen"]["exact_match,none"] <= 1.0, results
    assert len(out["samples"]["rs_choice"]) == len(CHOICE_DOCS)
    assert len(out["samples"]["rs_gen"]) == len(GEN_DOCS)
    assert all(isinstance(s["filtered_resps"][0], str) for s in out["samples"]["rs_gen"])

    # Every loglikelihood the harness scored (raysparse's echoed prompt logprobs over the continuation, dense)
    # is the sum of the plain forward's log-softmax over the same tokens.
    scored = 0
    for sample in out["samples"]["rs_choice"]:
        for (context, continuation), (ll, greedy) in zip(sample["arguments"], sample["filtered_resps"], strict=True):
            ctx, cont = lm._encode_pair(context, continuation)
            ids = ctx + cont
            ref = reference_logprobs(server["model"], ids)
            want = [float(ref[i - 1, ids[i]]) for i in range(len(ctx), len(ids))]
            assert abs(ll - sum(want)) <= 1e-4, (context, continuation, ll, sum(want))
            assert greedy == all(int(ref[i - 1].argmax()) == ids[i] for i in range(len(ctx), len(ids)))
            scored += 1
    assert scored == sum(len(d["choices"]) for d in CHOICE_DOCS)


def test_prompt_logprobs_alone_equal_a_plain_forward(server):
    """``echo`` + ``logprobs`` + ``max_tokens=0``: the prompt's logprobs alone, each the forward's within 1e-4."""
    openai = pytest.importorskip("openai")
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(server["model"])("The quick brown fox jumps over the lazy dog")["input_ids"]
    with openai.OpenAI(base_url=server["url"], api_key="unused", max_retries=0, timeout=60) as client:
        out = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1)
    got = out.choices[0].logprobs.token_logprobs
    ref = reference_logprobs(server["model"], ids)
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        assert abs(got[i] - float(ref[i - 1, ids[i]])) <= 1e-4, (i, got[i], float(ref[i - 1, ids[i]]))
