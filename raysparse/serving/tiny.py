"""A tiny random Llama with a character-level tokenizer, for smoke tests of the serving stack.

Every serving path (text prompts, streamed text deltas, documents plus questions in jobs, bench prompts cut
from real text) needs a tokenizer; the default model takes ~25 s to load on a small CPU, this one well under
a second. ``python -m raysparse.serving.tiny DIR`` writes it (weights, config, tokenizer) into ``DIR``.
"""

from __future__ import annotations

import string
import sys
from pathlib import Path

EOS = "</s>"
# A plain chat template for tests of chat endpoints (every character is a token of the tiny vocabulary)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def _tokenizer():  # noqa: ANN202 - a transformers fast tokenizer
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, EOS: 1}
    for c in string.printable:
        if c not in "\x0b\x0c\r":
            vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # characters join without spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token=EOS)


def write_tiny_model(directory: str | Path, seed: int = 0, layers: int = 2, max_positions: int = 1024,
                     chat_template: str | None = None, kv_heads: int = 2, group: int = 2) -> Path:
    """Writes a seeded random Llama (``kv_heads`` KV heads of ``group`` query heads each, 16 dimensions a
    head) and its tokenizer (with ``chat_template``, e.g. ``CHAT_TEMPLATE``, when given); returns the
    directory. Two of them with other depths and head counts share the tokenizer: a SpecAttn draft pair."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer()
    if chat_template is not None:
        tok.chat_template = chat_template
    cfg = LlamaConfig(vocab_size=128, hidden_size=16 * kv_heads * group, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=kv_heads * group, num_key_value_heads=kv_heads,
                      head_dim=16,
                      max_position_embeddings=max_positions, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      eos_token_id=tok.eos_token_id, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights than the init so greedy outputs differ from prompt to prompt
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m raysparse.serving.tiny DIR", file=sys.stderr)
        return 2
    print(write_tiny_model(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
