"""Write a LLaMA-family model and its tokenizer as one GGUF file (llama.cpp's format).

What the file holds is what llama.cpp's ``convert_hf_to_gguf.py`` writes for ``LlamaForCausalLM``
(SmolLM2, Llama 2/3 shapes), so that both llama.cpp and transformers' GGUF reader
(``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)``) load it:

* ``llama.*`` hyper-parameters (context length, widths, heads, KV heads, RMS eps, rope base, head
  dimension) and the tensors under GGUF names (``token_embd``, ``blk.N.attn_q`` ...,
  ``output_norm``; ``output`` only when the head is not tied to the embedding: a reader ties them
  when it is absent);
* the rows of ``q_proj`` and ``k_proj`` permuted (:func:`permute_qk`): transformers rotates the two
  halves of each head's dimensions (``rotate_half``), llama.cpp rotates adjacent pairs, so the
  converter reorders each head's rows from ``[x_0..x_{d/2-1}, y_0..y_{d/2-1}]`` to
  ``[x_0, y_0, x_1, y_1, ...]`` and every GGUF reader undoes it (transformers'
  ``LlamaTensorProcessor._reverse_permute_weights``). K is permuted per KV head (GQA);
* the tokenizer as metadata: ``tokenizer.ggml.model = "gpt2"`` (byte-level BPE) with tokens,
  merges, token types, the bos/eos/unk/pad ids, whether BOS/EOS are added, and the chat template,
  because a GGUF carries no ``tokenizer.json`` and transformers rebuilds the tokenizer from these.

Types (``--type``): ``f32``; ``f16`` (default) and ``bf16`` round every matrix; ``q8_0`` stores each
block of 32 weights of a row as int8 with one fp16 scale (``gguf.quants``; a matrix whose rows are
not a multiple of 32 long stays f16, as llama.cpp does). Norm weights (1-D) stay f32 in every type.
The file is written to a temporary name and renamed into place, so a failed export leaves no half
file. :mod:`posttrain.run.export` is the ``posttrain export`` command around :func:`write_gguf`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.models.load import INSTALL_GGUF, ModelLoadError, gguf_available

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType, GGUFWriter

GGUFType = Literal["f32", "f16", "bf16", "q8_0"]
GGUF_TYPES: tuple[str, ...] = ("f32", "f16", "bf16", "q8_0")
LLAMA_FAMILY = ("llama",)  # config.model_type values written as general.architecture = "llama"
Q8_BLOCK = 32  # weights per q8_0 block (GGML_QUANT_SIZES[Q8_0][0])


class GGUFExportError(ModelLoadError):
    """A model, tokenizer or output path that GGUF export cannot take; the message says why and what to do."""


def check_gguf() -> None:
    """Raise :class:`GGUFExportError` with the install command when the ``gguf`` package is missing."""
    if not gguf_available():
        raise GGUFExportError(f"GGUF export needs the gguf package: {INSTALL_GGUF}")


def check_architecture(config: object, source: str) -> None:
    """Refuse anything but a plain LLaMA: another architecture, rope scaling, biases or another activation
    would be written as a file that loads without error and computes something else.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in LLAMA_FAMILY:
        arch = ", ".join(getattr(config, "architectures", None) or []) or "no architectures listed"
        raise GGUFExportError(
            f"{source}: GGUF export writes LLaMA-family models (config model_type 'llama', LlamaForCausalLM, e.g. "
            f"SmolLM2); this model's architecture is {model_type!r} ({arch})"
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    unsupported = {
        "rope scaling": rope.get("rope_type", rope.get("type", "default")) not in ("default", None),
        "attention_bias": bool(getattr(config, "attention_bias", False)),
        "mlp_bias": bool(getattr(config, "mlp_bias", False)),
        f"hidden_act={getattr(config, 'hidden_act', 'silu')!r}": getattr(config, "hidden_act", "silu") != "silu",
    }
    found = [k for k, bad in unsupported.items() if bad]
    if found:
        raise GGUFExportError(f"{source}: a LLaMA with {', '.join(found)} is not supported by GGUF export "
                              "(transformers' GGUF reader would load it as a plain LLaMA)")


def permute_qk(w_OI: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``permute`` of a q/k projection ``[n_head * d, in]``: per head, rows
    ``[x_0..x_{d/2-1}, y_0..y_{d/2-1}]`` (transformers' rotate-half layout) become
    ``[x_0, y_0, x_1, y_1, ...]`` (llama.cpp's adjacent-pair rotary). ``n_head``: the heads of this
    projection (``num_key_value_heads`` for k).
    """
    out = w_OI.shape[0]
    return w_OI.reshape(n_head, 2, out // n_head // 2, *w_OI.shape[1:]).swapaxes(1, 2).reshape(w_OI.shape)


def _head_dim(config: object) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rope_theta(config: object) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _encode(w: torch.Tensor, kind: GGUFType) -> tuple[np.ndarray, GGMLQuantizationType]:
    """``w`` as the array the writer stores and its GGML type: 1-D tensors stay f32; q8_0 falls back to
    f16 for rows that are not whole blocks (llama.cpp's rule).
    """
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    a = w.detach().to(device="cpu", dtype=torch.float32).numpy()
    if a.ndim == 1 or kind == "f32":
        return a, Q.F32
    if kind == "f16" or (kind == "q8_0" and a.shape[-1] % Q8_BLOCK):
        return a.astype(np.float16), Q.F16
    qtype = Q.BF16 if kind == "bf16" else Q.Q8_0
    return quants.quantize(a, qtype), qtype


def gguf_tensors(model: PreTrainedModel) -> list[tuple[str, torch.Tensor]]:
    """``(GGUF name, tensor)`` for every weight of a LLaMA ``model``, q/k permuted, ``output.weight``
    left out when the head is tied to the embedding. Any weight without a GGUF name is an error.
    """
    from gguf import MODEL_ARCH, get_tensor_name_map

    config = model.config
    names = get_tensor_name_map(MODEL_ARCH.LLAMA, config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    out: list[tuple[str, torch.Tensor]] = []
    for hf_name, w in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        base, _, suffix = hf_name.rpartition(".")
        gguf_base = names.get_name(base)
        if gguf_base is None or suffix != "weight":
            raise GGUFExportError(f"weight {hf_name!r} has no GGUF tensor name in llama.cpp's LLaMA layout")
        if gguf_base.endswith(".attn_q"):
            w = permute_qk(w, config.num_attention_heads)
        elif gguf_base.endswith(".attn_k"):
            w = permute_qk(w, config.num_key_value_heads)
        out.append((f"{gguf_base}.weight", w))
    return out


def _add_hparams(writer: GGUFWriter, config: object) -> None:
    """The ``llama.*`` keys transformers' reader maps back onto a ``LlamaConfig`` (and llama.cpp reads)."""
    head_dim = _head_dim(config)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_rope_dimension_count(head_dim)  # transformers reads it as head_dim
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)


@dataclass(frozen=True)
class GGUFVocab:
    """A tokenizer as GGUF metadata: byte-level spelled tokens by id, their llama.cpp types, the merges
    (``"a b"``) and the pre-tokenizer name (``tokenizer.ggml.pre``).
    """

    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str


def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what byte-level BPE vocabularies are spelled in)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return bytes_to_unicode()


def _is_byte_level(spec: dict) -> bool:
    return "ByteLevel" in json.dumps(spec.get("pre_tokenizer")) or "ByteLevel" in json.dumps(spec.get("decoder"))


def _model_vocab(spec: dict, added: set[str]) -> tuple[dict[str, int], list[str]]:
    """The vocabulary and merges of a byte-level BPE, or of a character-level WordLevel (posttrain's tiny
    tokenizer), spelled in the byte alphabet: a BPE without merges over single bytes tokenizes alike.
    """
    model = spec["model"]
    kind = model.get("type")
    if kind == "BPE":
        if not _is_byte_level(spec):
            raise GGUFExportError("the tokenizer is a BPE without byte-level pre-tokenization (a sentencepiece-style "
                                  "vocabulary); GGUF export writes byte-level BPE (tokenizer.ggml.model = 'gpt2') only")
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
        return dict(model["vocab"]), merges
    if kind == "WordLevel":
        spell = _byte_spelling()
        vocab = {}
        for token, i in model["vocab"].items():
            raw = token.encode("utf-8")
            if token not in added and len(raw) != 1:
                raise GGUFExportError(f"the tokenizer is word-level with token {token!r}, which is not one byte: a "
                                      "byte-level GGUF vocabulary without merges cannot spell it")
            vocab[token if token in added else spell[raw[0]]] = i
        return vocab, []
    raise GGUFExportError(f"the tokenizer's model is {kind!r}; GGUF export writes byte-level BPE "
                          "(tokenizer.ggml.model = 'gpt2') and character-level WordLevel tokenizers")


def _pre_name(spec: dict) -> str:
    """``tokenizer.ggml.pre``: the llama.cpp name of the pre-tokenizer, where it has one: ``gpt-2``
    (ByteLevel's own regex), ``smollm`` (single digits, then ByteLevel), a regex that transformers'
    GGUF reader knows by name; else ``default``.
    """
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    types = [p.get("type") for p in parts]
    if types == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if types == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
        return "smollm"
    if types == ["Split", "ByteLevel"]:
        regex = (parts[0].get("pattern") or {}).get("Regex")
        try:
            from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
        except ImportError:  # an older transformers: no named splits to match
            return "default"
        return next((name for name, split in GGUF_PRE_TOKENIZER_SPLITS.items() if split == regex), "default")
    return "default"


def gguf_vocab(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> GGUFVocab:
    """The GGUF vocabulary of a fast ``tokenizer`` for a model of ``vocab_size`` rows: special added
    tokens are CONTROL, other added tokens USER_DEFINED, ids the tokenizer leaves unused up to
    ``vocab_size`` are ``[PAD<id>]`` tokens of type UNUSED (llama.cpp's padding).
    """
    from gguf import TokenType

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GGUFExportError(f"the tokenizer ({type(tokenizer).__name__}) is not a fast (tokenizers) tokenizer; "
                              "GGUF export reads the vocabulary and merges from tokenizer.json")
    spec = json.loads(backend.to_str())
    added = {t.content: t.special for t in tokenizer.added_tokens_decoder.values()}
    vocab, merges = _model_vocab(spec, set(added))
    vocab.update({t.content: i for i, t in tokenizer.added_tokens_decoder.items()})
    too_big = {t: i for t, i in vocab.items() if i >= vocab_size}
    if too_big:
        raise GGUFExportError(f"the tokenizer has ids beyond the model's vocab_size {vocab_size}: "
                              f"{dict(list(too_big.items())[:5])}")
    tokens: list[str | None] = [None] * vocab_size
    types = [int(TokenType.UNUSED)] * vocab_size
    for token, i in vocab.items():
        tokens[i] = token
        special = added.get(token)  # None: a token of the model's own vocabulary
        kind = TokenType.NORMAL if special is None else TokenType.CONTROL if special else TokenType.USER_DEFINED
        types[i] = int(kind)
    filled = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    return GGUFVocab(filled, types, merges, _pre_name(spec))


def _adds(tokenizer: PreTrainedTokenizerBase, token_id: int | None, first: bool) -> bool:
    """Whether encoding with special tokens puts ``token_id`` first (BOS) or last (EOS): what
    ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` say to a reader.
    """
    if token_id is None:
        return False
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0 if first else -1] == token_id and len(ids) > len(
        tokenizer("a", add_special_tokens=False)["input_ids"])


def _add_tokenizer(writer: GGUFWriter, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
    """``tokenizer.ggml.*`` and ``tokenizer.chat_template``."""
    vocab = gguf_vocab(tokenizer, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)  # the writer drops an empty array ...
    if not vocab.merges:  # ... and a reader without merges derives them from scores: none from single bytes
        writer.add_token_scores([0.0] * len(vocab.tokens))
    for value, add in ((tokenizer.bos_token_id, writer.add_bos_token_id),
                       (tokenizer.eos_token_id, writer.add_eos_token_id),
                       (tokenizer.unk_token_id, writer.add_unk_token_id),
                       (tokenizer.pad_token_id, writer.add_pad_token_id)):
        if value is not None:
            add(int(value))
    writer.add_add_bos_token(_adds(tokenizer, tokenizer.bos_token_id, first=True))
    writer.add_add_eos_token(_adds(tokenizer, tokenizer.eos_token_id, first=False))
    writer.add_add_space_prefix(False)
    if isinstance(getattr(tokenizer, "chat_template", None), str):
        writer.add_chat_template(tokenizer.chat_template)


def _file_type(kind: GGUFType) -> int:
    from gguf import LlamaFileType as F

    return int({"f32": F.ALL_F32, "f16": F.MOSTLY_F16, "bf16": F.MOSTLY_BF16, "q8_0": F.MOSTLY_Q8_0}[kind])


def write_gguf(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: str | Path, *,
               kind: GGUFType = "f16", name: str | None = None, force: bool = False) -> Path:
    """Write ``model`` (a plain ``LlamaForCausalLM``) and ``tokenizer`` to the GGUF file ``out``, in
    ``kind`` (``f32 | f16 | bf16 | q8_0``). An existing ``out`` is replaced only with ``force``. The file
    is written beside ``out`` under a temporary name and renamed into place. Returns ``out``.
    """
    check_gguf()
    from gguf import GGML_QUANT_VERSION, GGUFWriter

    out = Path(out)
    if kind not in GGUF_TYPES:
        raise GGUFExportError(f"--type {kind!r} is not one of {list(GGUF_TYPES)}")
    if out.exists() and not force:
        raise GGUFExportError(f"{out} exists; pass --force to overwrite it")
    if out.is_dir():
        raise GGUFExportError(f"{out} is a directory; give the path of the .gguf file to write")
    check_architecture(model.config, name or "the model")
    tensors = gguf_tensors(model)  # every name checked before anything is written
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    writer = GGUFWriter(tmp, "llama")
    try:
        writer.add_type("model")
        writer.add_name(name or str(getattr(model.config, "_name_or_path", "") or "posttrain export"))
        writer.add_description("exported by posttrain (posttrain export --gguf)")
        _add_hparams(writer, model.config)
        writer.add_file_type(_file_type(kind))
        writer.add_quantization_version(GGML_QUANT_VERSION)
        _add_tokenizer(writer, tokenizer, model.config.vocab_size)
        for gguf_name, w in tensors:
            data, qtype = _encode(w, kind)
            writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return out


__all__ = ["GGUF_TYPES", "GGUFExportError", "GGUFType", "GGUFVocab", "check_architecture", "check_gguf",
           "gguf_tensors", "gguf_vocab", "permute_qk", "write_gguf"]
