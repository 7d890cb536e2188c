"""Models: the one loading path (``load``) and the tiny-model factory (``tiny``)."""

from posttrain.models.load import ModelLoadError, encode_chat, load_model, load_tokenizer
from posttrain.models.tiny import TinySpec, build_char_tokenizer, build_tiny

__all__ = [
    "ModelLoadError",
    "encode_chat",
    "TinySpec",
    "build_char_tokenizer",
    "build_tiny",
    "load_model",
    "load_tokenizer",
]
