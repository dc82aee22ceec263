"""Is the needle in the selection when the answer is produced? Per layer, for Sketch&Walk's walks, Quest and oracle.

For each sample of a retrieval task (``raysparse eval``'s own prompts), the prompt plus the expected answer is run
once densely, recording every layer's post-RoPE q and k (teacher forcing: the selections below all see the dense
run's q and k, so the numbers isolate selection). Each method then runs its own code on them, in the engine's
order: ``select_prefill`` of the prompt at every layer, then ``select_decode`` for each answer token, layer by
layer. Answer steps: the prompt's last position (its selection is the prefill's last query block's; it predicts
the first answer token) and every decode step that predicts a later answer token. With ``--answers`` (a dense
eval run's JSON) the forced answer is the dense model's own output, preamble included, and the decode steps kept
are those that predict a value token in it: a chatty model's first answer token is a word, not a value.

Per layer and answer step it reports, averaged over samples, steps and the answer's needles (the value tokens
of every expected answer in the haystack):
- ``hit_prefill`` / ``hit_decode``: the fraction of KV heads whose selection holds the needle's value tokens (all
  of them), at the prompt's last position (the prefill's last query block) / at the decode steps;
- ``cover_prefill`` / ``cover_decode``: the dense attention mass on the value tokens that the selection keeps,
  over all of it (summed over query heads: the heads that do attend the needle weigh most);
- for Sketch&Walk settings, ``rank``: the needle block's rank in the walk row the method selected by (1 = best,
  among the non-forced causal blocks; the budget takes the top tau - forced; with ``heads=kv`` the best KV head;
  with ``decode_unit=part`` at the prompt's last position only);
- the ``true`` ranks of the needle block by the dense attention mass at that query position: of the mass
  averaged over all query heads (one selection per layer, as Sketch&Walk makes) and the best rank over KV heads
  of the mass averaged over each KV group (per-KV-head selection, as Quest makes); and ``mass``, the dense
  attention on the value tokens (mean over query heads), which shows the layers that retrieve.

Usage: python benchmarks/probe_needle.py [--task single_needle|multi_key|multi_value] [--samples 4]
       [--density 0.2] [--setting 'sketch_walk:walk=one-hop;token_query=last'] ... [--threads 1] [--json PATH]
       [--answers EVAL_JSON]
       [--tiny]   (no --setting: the walks, token queries, heads and key-part options of BENCHMARKS.md, Quest,
                   oracle; ``sketch_walk`` alone is the default: heads=pair-lse, sub_blocks=8, decode_unit=part)
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from needle_ranks import rank_of, true_ranks
from probe_sketch_walk import Recorder

from raysparse.kv_cache import KVCache
from raysparse.methods.registry import create_backend
from raysparse.methods.selection import SENTINEL
from raysparse.methods.views import SeqContext

SPEC_SCORING = "heads=mean;sub_blocks=1;decode_unit=block"  # the scoring of every setting before the key parts
DEFAULT_SETTINGS = tuple(f"sketch_walk:{s};{SPEC_SCORING}" for s in (
    "walk=rollout;token_query=never", "walk=rollout;token_query=decode", "walk=product;token_query=never",
    "walk=one-hop;token_query=never", "walk=one-hop;token_query=decode", "walk=one-hop;token_query=last")) + (
    "sketch_walk:walk=one-hop;token_query=decode;heads=kv;sub_blocks=1;decode_unit=block",
    "sketch_walk:walk=one-hop;token_query=last;heads=kv;sub_blocks=1;decode_unit=block",
    "sketch_walk:walk=rollout;token_query=decode;heads=kv;sub_blocks=1;decode_unit=block",
    "sketch_walk:heads=pair;sub_blocks=1;decode_unit=block",
    "sketch_walk:heads=pair-lse;sub_blocks=1;decode_unit=block",
    "sketch_walk:heads=pair-lse;sub_blocks=4;decode_unit=block", "sketch_walk", "quest", "oracle")


def parse_setting(text: str) -> tuple[str, dict]:
    """``sketch_walk:walk=one-hop;exponent=4`` -> ("sketch_walk", {"walk": "one-hop", "exponent": 4.0})."""
    name, _, rest = text.partition(":")
    params: dict = {}
    for item in filter(None, rest.split(";")):
        key, val = item.split("=")
        for cast in (int, float, str):
            try:
                params[key] = cast(val)
                break
            except ValueError:
                continue
    return name, params


def find_span(ids: list[int], sub: list[int]) -> int:
    """First index of ``sub`` inside ``ids`` (-1 if absent)."""
    for i in range(len(ids) - len(sub) + 1):
        if ids[i: i + len(sub)] == sub:
            return i
    return -1


def selected_tokens(indices: torch.Tensor, unit: int, n: int) -> torch.Tensor:
    """bool [h_kv, n]: the keys covered by per-head index lists of ``unit``-token units."""
    h = indices.shape[0]
    out = torch.zeros(h, -(-n // unit) + 1, dtype=torch.bool)
    idx = indices.long().clone()
    idx[indices == SENTINEL] = out.shape[1] - 1
    out.scatter_(1, idx, True)
    return out[:, :-1].repeat_interleave(unit, 1)[:, :n]


def run_setting(name: str, params: dict, mcfg, qk: dict, prompt_len: int, steps: list[int], density: float,
                needles: list[tuple[int, int]]) -> dict[int, dict[str, list[float]]]:
    """Per layer: ``hit_*`` and ``cover_*`` (and ``rank`` for Sketch&Walk) at each answer step and needle."""
    backend = create_backend(name, mcfg, **{"density": density, **params})
    states: dict[int, dict] = {}
    seq_state: dict = {}
    out: dict[int, dict[str, list[float]]] = {}
    block = backend.config.block_size
    layers = [layer for layer in sorted(qk) if not backend.is_dense_layer(layer)]

    def record(layer: int, t: int, sel_idx: torch.Tensor, unit: int) -> None:
        covered = selected_tokens(sel_idx, unit, t + 1)
        row = out.setdefault(layer, {})
        q, k = qk[layer]
        g = q.shape[1] // k.shape[0]
        p = (torch.einsum("hd,hnd->hn", q[t], k[:, : t + 1].repeat_interleave(g, 0)) / math.sqrt(q.shape[-1]))
        p = p.softmax(-1)  # dense attention of every query head at step t
        phase = "prefill" if t == prompt_len - 1 else "decode"
        for start, length in needles:
            hit = float(covered[:, start: start + length].all(1).float().mean())
            row.setdefault(f"hit_{phase}", []).append(hit)
            on = p[:, start: start + length]
            kept = (on * covered.repeat_interleave(g, 0)[:, start: start + length]).sum()
            row.setdefault(f"cover_{phase}", []).append(float(kept / on.sum()))
            if name == "sketch_walk" and (phase == "prefill" or backend.config.decode_unit == "block"):
                walk = seq_state["walk"][1]  # heads=kv: one walk per KV head, of which the best rank counts
                scores = walk[..., -1, :].reshape(-1, walk.shape[-1])
                qb = t // block
                forced = {0, *range(max(0, qb - backend.config.local_blocks + 1), qb + 1)}
                blocks = sorted({p // block for p in range(start, start + length)})
                row.setdefault("rank", []).append(float(min(rank_of(x, blocks, forced) for x in scores)))

    for layer in layers:  # prefill of the prompt
        q, k = qk[layer]
        states[layer] = {}
        sel = backend.select_prefill(SeqContext(layer, 0, 0, prompt_len, states[layer], seq_state),
                                     q[:prompt_len], k[:, :prompt_len], k[:, :prompt_len])
        if steps[0] == prompt_len - 1:
            record(layer, prompt_len - 1, sel.indices[:, -1], sel.block_size)
    for t in range(prompt_len, steps[-1] + 1):  # teacher-forced decode steps
        for layer in layers:
            q, k = qk[layer]
            sel = backend.select_decode(SeqContext(layer, 0, t, t + 1, states[layer], seq_state),
                                        q[t], k[:, : t + 1], k[:, : t + 1])
            if t in steps:
                record(layer, t, sel.indices, sel.block_size)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="single_needle", help="single_needle, multi_key or multi_value")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--context-tokens", type=int, default=2048)
    ap.add_argument("--density", type=float, default=0.2)
    ap.add_argument("--setting", action="append", default=[],
                    help="METHOD[:KEY=V;KEY=V] (repeatable; default: Sketch&Walk's walks, quest, oracle)")
    ap.add_argument("--json", default="", help="also write the numbers to this file")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--tiny", action="store_true", help="a random 4-layer model (a CPU smoke test of the script)")
    ap.add_argument("--answers", default="", help="a dense run's eval.json (raysparse eval --out): teacher-force the "
                    "dense model's own output for each sample instead of the bare values, and record the prompt's "
                    "last position and the steps that predict a value token of that output")
    args = ap.parse_args()
    settings = args.setting or list(DEFAULT_SETTINGS)
    if args.threads:
        torch.set_num_threads(args.threads)

    from raysparse.eval.tasks import build_task
    from raysparse.loader import load_tokenizer, materialize, resolve_source
    from raysparse.workload import load_haystack_text
    src = materialize(resolve_source(None))
    tok = load_tokenizer(src)
    text, source = load_haystack_text(None)
    if args.tiny:
        from transformers import LlamaConfig, LlamaForCausalLM

        from raysparse.loader import model_from_state
        hf = LlamaConfig(vocab_size=len(tok), hidden_size=96, intermediate_size=160, num_hidden_layers=4,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192)
        torch.manual_seed(0)
        model = model_from_state(hf, LlamaForCausalLM(hf).state_dict(), torch.float32, "cpu")
    else:
        from raysparse.loader import load_hf_config, load_model
        model = load_model(src, hf_config=load_hf_config(src))
    mcfg = model.cfg

    outputs: dict[int, str] = {}
    if args.answers:  # the dense run's own outputs: a chatty model writes a preamble before the values
        with open(args.answers) as f:
            dense = next(r for r in json.load(f)["runs"] if r["method"] == "dense")
        outputs = {x["seed"]: x["output"] for x in dense["samples"] if x["task"] == args.task}
    per_setting: dict[str, dict[int, dict[str, list[float]]]] = {}
    truth: dict[int, dict[str, list[float]]] = {}
    for s in range(args.seed, args.seed + args.samples):
        task = build_task(args.task, tok, text, source, args.context_tokens, s)
        prompt = list(task.prompt_ids)
        answer = tok(outputs[s] if args.answers else ", ".join(task.expected), add_special_tokens=False)["input_ids"]
        ids = prompt + answer
        needles = []
        for value in task.expected:
            sub = tok(value, add_special_tokens=False)["input_ids"]
            at = find_span(prompt, sub)
            if at < 0:
                raise RuntimeError(f"{args.task} seed {s}: value {value} not found as tokens in the prompt")
            needles.append((at, len(sub)))
        # The prompt's last position predicts the first answer token; decode steps predict the rest.
        steps = list(range(len(prompt) - 1, len(ids) - 1))
        if args.answers:  # the last position, and the steps predicting a token of a value the output holds
            value_steps = set()
            for value in task.expected:
                sub = tok(value, add_special_tokens=False)["input_ids"]
                at = find_span(answer, sub)
                value_steps |= set(range(len(prompt) + at - 1, len(prompt) + at - 1 + len(sub))) if at >= 0 else set()
            steps = sorted({len(prompt) - 1} | value_steps)
        rec = Recorder(mcfg)
        cache = KVCache(mcfg, -(-len(ids) // 64), 64)
        cache.allocate(0, len(ids))
        with torch.no_grad():
            model(torch.tensor(ids), cache.prepare([0], [len(ids)], True), cache, rec, all_logits=False)
            layers = sorted(rec.qk)
            for layer, row in true_ranks(rec.qk, layers[2:], steps, needles, 64, args.density).items():
                for key, vals in row.items():
                    truth.setdefault(layer, {}).setdefault(key, []).extend(vals)
            for setting in settings:
                name, params = parse_setting(setting)
                res = run_setting(name, params, mcfg, rec.qk, len(prompt), steps, args.density, needles)
                for layer, row in res.items():
                    for key, vals in row.items():
                        per_setting.setdefault(setting, {}).setdefault(layer, {}).setdefault(key, []).extend(vals)
        print(f"sample {s}: {len(prompt)} prompt tokens, needles at {[a for a, _ in needles]}, {len(steps)} steps",
              flush=True)

    def mean(v: list[float]) -> float:
        return sum(v) / len(v)

    cols: dict[str, dict[int, float]] = {}
    for key in next(iter(truth.values())):
        cols[key] = {layer: mean(row[key]) for layer, row in truth.items()}
    for setting, rows in per_setting.items():
        for key in ("hit_prefill", "hit_decode", "cover_prefill", "cover_decode", "rank"):
            if all(key in row for row in rows.values()):
                cols[f"{key} {setting}"] = {layer: mean(row[key]) for layer, row in rows.items()}
    layers = sorted(truth)
    print(f"{args.task}, {args.samples} samples from seed {args.seed}, {args.context_tokens} tokens, density "
          f"{args.density}; per layer, mean over answer steps and needles")
    for i, name in enumerate(cols):
        print(f"  c{i}: {name}")
    print("layer " + " ".join(f"{'c' + str(i):>6s}" for i in range(len(cols))))
    for layer in layers:
        print(f"{layer:5d} " + " ".join(f"{cols[c].get(layer, math.nan):6.3f}" for c in cols))
    print(" mean " + " ".join(f"{mean(list(cols[c].values())):6.3f}" for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"task": args.task, "samples": args.samples, "seed": args.seed, "source": source,
                       "context_tokens": args.context_tokens, "density": args.density,
                       "columns": {c: {str(k): v for k, v in vals.items()} for c, vals in cols.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
