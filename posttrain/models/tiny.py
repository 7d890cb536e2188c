"""Tiny LLaMA models with a character-level tokenizer, saved in Hugging Face format.

The factory writes a real ``LlamaForCausalLM`` and a ``PreTrainedTokenizerFast`` with
``save_pretrained``; everything else in posttrain loads them back with
``AutoModelForCausalLM`` / ``AutoTokenizer`` exactly as it would load a hub model, so tests and
the demo exercise the real loading path.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, PreTrainedTokenizerFast

SPECIAL_TOKENS = {"pad": "<|pad|>", "bos": "<|bos|>", "eos": "<|eos|>", "unk": "<|unk|>"}
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]

# A chat template made of role tokens only: a character vocabulary cannot spell role names
# cheaply, and single tokens keep tiny-model prompts short. A tool result reads like a user turn
# (a role token of its own would shift every character's id).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>{{ m['content'] }}"
    "{% elif m['role'] in ['user', 'tool'] %}<|user|>{{ m['content'] }}"
    "{% else %}<|assistant|>{{ m['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Printable ASCII (95 symbols): the "~100-symbol" vocabulary of the benchmark setting.
PRINTABLE = "".join(chr(c) for c in range(32, 127))


@dataclass(frozen=True)
class TinySpec:
    """Architecture of a tiny LLaMA. Defaults: ~0.5M parameters."""

    alphabet: str = "0123456789+*="
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 3
    num_heads: int = 4
    max_positions: int = 256
    seed: int = 0


def build_char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer over ``alphabet`` with pad/bos/eos and role tokens."""
    chars = sorted(set(alphabet))
    specials = [*SPECIAL_TOKENS.values(), *ROLE_TOKENS]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in chars:
        vocab[ch] = len(vocab)
    unk = SPECIAL_TOKENS["unk"]
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join without spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=SPECIAL_TOKENS["pad"],
        bos_token=SPECIAL_TOKENS["bos"],
        eos_token=SPECIAL_TOKENS["eos"],
        unk_token=unk,
        additional_special_tokens=ROLE_TOKENS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def build_tiny(out_dir: str | Path, spec: TinySpec, *, head: str = "causal_lm") -> Path:
    """Build a randomly initialised tiny LLaMA + char tokenizer and save both to ``out_dir``.

    ``head="causal_lm"`` builds a policy (``LlamaForCausalLM``); ``head="reward"`` a reward model
    (``LlamaForSequenceClassification`` with one output, read at the last non-pad token), which
    ``AutoModelForSequenceClassification`` loads back. Deterministic in ``spec.seed``. Returns
    ``out_dir``. Writes ``tiny_spec.json`` beside the model so a directory can be recognised and
    reused.
    """
    if head not in ("causal_lm", "reward"):
        raise ValueError(f"head must be 'causal_lm' or 'reward', got {head!r}")
    out = Path(out_dir)
    tokenizer = build_char_tokenizer(spec.alphabet)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        num_labels=1,
    )
    # fork_rng so building a model never disturbs the caller's random stream
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config) if head == "causal_lm" else LlamaForSequenceClassification(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "tiny_spec.json").write_text(json.dumps(asdict(spec), indent=2))
    return out


def count_parameters(model: torch.nn.Module) -> int:
    """Number of parameters."""
    return sum(p.numel() for p in model.parameters())
