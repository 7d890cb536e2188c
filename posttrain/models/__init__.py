"""Models: the one loading path (``load``: directories, hub ids, ``.gguf`` files, aliases, the device)
and the tiny-model factory (``tiny``).
"""

from posttrain.models.chat import ChatRenderError, encode_example
from posttrain.models.load import (
    ALIASES,
    ModelLoadError,
    check_model_path,
    encode_chat,
    load_model,
    load_tokenizer,
    resolve_device,
)
from posttrain.models.tiny import TinySpec, build_char_tokenizer, build_tiny

__all__ = [
    "ALIASES",
    "ChatRenderError",
    "ModelLoadError",
    "check_model_path",
    "encode_chat",
    "encode_example",
    "TinySpec",
    "build_char_tokenizer",
    "build_tiny",
    "load_model",
    "load_tokenizer",
    "resolve_device",
]
