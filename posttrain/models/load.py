"""Load a policy (and tokenizer) from a Hugging Face path: the one loading code of posttrain."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers import logging as hf_logging

hf_logging.disable_progress_bar()  # our own progress display owns the terminal

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    """A model path or id could not be loaded; the message says why and what to do."""


def _check_path(path: str) -> None:
    looks_local = path.startswith((".", "/", "~")) or os.sep in path and not _looks_like_hub_id(path)
    if looks_local and not Path(path).expanduser().exists():
        raise ModelLoadError(f"model path {path!r} does not exist")
    p = Path(path).expanduser()
    if p.is_dir() and not (p / "config.json").exists():
        raise ModelLoadError(
            f"model directory {path!r} has no config.json: it is not a Hugging Face model directory"
        )


def _looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not Path(path).exists()


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Load a tokenizer with ``AutoTokenizer``; pads on the left for generation."""
    _check_path(path)
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except OSError as e:
        raise ModelLoadError(f"could not load a tokenizer from {path!r}: {e}") from e
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str, dtype: str = "float32", device: str = "cpu") -> PreTrainedModel:
    """Load a causal LM with ``AutoModelForCausalLM`` (local directory or hub id)."""
    _check_path(path)
    if dtype not in _DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype])
    except OSError as e:
        raise ModelLoadError(f"could not load a model from {path!r}: {e}") from e
    return model.to(device)


def encode_chat(tokenizer: PreTrainedTokenizerBase, user: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat prompt through the tokenizer's chat template.

    Falls back to the raw text (with BOS when the tokenizer has one) for tokenizers without a
    chat template, e.g. base models.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}
        ]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = (system + "\n" if system else "") + user
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])
