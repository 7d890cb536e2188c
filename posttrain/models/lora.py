"""LoRA through ``peft``: the adapter is trained, checkpointed and synced; the base stays frozen.

:func:`apply_lora` injects the adapters of ``[model.lora]`` into the loaded policy *in place* and
returns the ``PeftModel`` around it. The training code keeps using the Hugging Face model itself
(``peft_model.get_base_model()``, the same object): its forward, ``get_decoder()``,
``get_output_embeddings()`` and the modules the rollout engine runs now carry the adapters, so no
code path needs to know about ``peft``. The ``PeftModel`` is kept for what only it does: switch
the adapter off (:class:`AdapterDisabled`, the reference model without a second copy of the
weights), save and load the adapter (a checkpoint holds ``adapter_model.safetensors`` +
``adapter_config.json``, not the base weights) and merge it into a plain model
(:func:`export_merged`). :func:`posttrain.models.load.load_merged` reads an adapter checkpoint back as a plain model, so
a LoRA run's checkpoint or run directory can be a ``model.path``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.errors import ConfigError

if TYPE_CHECKING:
    from peft import PeftModel

    from posttrain.config.model import LoraSettings

INSTALL_PEFT = "pip install 'posttrain[peft]'  (or: pip install peft)"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def check_peft(why: str = "model.lora.rank > 0 trains a LoRA adapter") -> None:
    """Raise :class:`ConfigError` (``why``, then the install command) when ``peft`` is not importable."""
    if importlib.util.find_spec("peft") is None:
        raise ConfigError(f"{why}, which needs the peft package: {INSTALL_PEFT}")


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of ``model``'s linear layers (``q_proj``, ``lm_head``, ...): what
    ``model.lora.target_modules`` may name. GPT-2's ``Conv1D`` counts as linear (peft adapts it).
    """
    kinds: tuple[type, ...] = (torch.nn.Linear,)
    with contextlib.suppress(ImportError):
        from transformers.pytorch_utils import Conv1D

        kinds = (torch.nn.Linear, Conv1D)
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if name and isinstance(m, kinds)})


def apply_lora(model: PreTrainedModel, settings: LoraSettings, base_path: str | None = None) -> PeftModel:
    """Inject LoRA adapters (rank ``settings.rank``, scale ``alpha / rank``, dropout on the adapter's
    input, B = 0 so the policy starts equal to the base) into ``settings.target_modules`` of
    ``model``, in place; freeze everything else. Returns the ``PeftModel``;
    ``peft_model.get_base_model() is model``. ``base_path`` is recorded in the adapter's config
    (what :func:`posttrain.models.load.load_merged` loads the base from).

    Raises:
        ConfigError: peft is not installed, or a target module is not a linear layer of ``model``
            (the message lists the ones it has).

    """
    check_peft()
    from peft import LoraConfig, get_peft_model

    have = linear_module_names(model)
    missing = [t for t in settings.target_modules if t not in have]
    if missing:
        raise ConfigError(
            f"model.lora.target_modules: {missing} are not linear modules of this model "
            f"({type(model).__name__}); its linear modules are {have}"
        )
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.target_modules), bias="none", task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft reads transformers' deprecated `is_gradient_checkpointing`
        warnings.filterwarnings("ignore", category=FutureWarning)
        peft_model = get_peft_model(model, config)
    if base_path is not None:
        peft_model.peft_config["default"].base_model_name_or_path = base_path
    return peft_model


def adapter_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """The adapter's tensors under ``model``'s own state-dict names (``...q_proj.lora_A.default.weight``):
    what a LoRA learner hands to the rollout engine, which holds the same module (the base weights
    never change).
    """
    return {k: v for k, v in model.state_dict().items() if ".lora_" in k}


def merged_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """A LoRA policy (its ``PeftModel``, or the module the adapters were injected into) as a plain
    model's state dict: every base weight under the base model's own names (no ``base_model.model.``
    prefix, no ``.base_layer``, no adapter tensors), each adapted linear's weight W + (alpha / r) B A
    (peft's ``get_delta_weight``). The module is not touched (no merge and unmerge, which would leave
    rounding in the base weights).
    """
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PeftModel or the module
    out = {k.replace(".base_layer.", "."): v for k, v in base.state_dict().items() if ".lora_" not in k}
    with torch.no_grad():
        for name, m in base.named_modules():
            if isinstance(m, LoraLayer):
                for adapter in m.active_adapters:
                    w = out[f"{name}.weight"]
                    out[f"{name}.weight"] = w + m.get_delta_weight(adapter).to(w.dtype)
    return out


def engine_weights(model: torch.nn.Module, engine: object) -> dict[str, Tensor]:
    """The policy's weights as ``engine`` takes them at a sync: an engine with its own plain copy of the
    model (``engine.full_weights``: vLLM) gets every weight, a LoRA policy's adapters merged in
    (:func:`merged_state_dict`); one that runs the policy module or a copy of it (hf) gets what
    training changes (a LoRA policy's adapter tensors, else every weight).
    """
    lora = hasattr(model, "peft_config")
    if getattr(engine, "full_weights", False):
        return merged_state_dict(model) if lora else model.state_dict()
    return adapter_state_dict(model) if lora else model.state_dict()


class AdapterSaver:
    """What a LoRA run's checkpoint writes: ``save_pretrained`` saves the adapter only
    (``adapter_model.safetensors`` + ``adapter_config.json``), never the embedding layers (the base
    is read from its own path), so peft makes no hub look-up for the base model's config.
    """

    def __init__(self, peft_model: PeftModel) -> None:
        self.peft_model = peft_model

    def save_pretrained(self, path: str | Path, safe_serialization: bool = True) -> None:
        """Write the adapter into directory ``path``."""
        self.peft_model.save_pretrained(path, safe_serialization=safe_serialization, save_embedding_layers=False)


def is_adapter_dir(path: str | Path) -> bool:
    """Whether ``path`` is an adapter checkpoint (``adapter_config.json``, no ``config.json``)."""
    p = Path(path)
    return p.is_dir() and (p / ADAPTER_CONFIG).exists() and not (p / "config.json").exists()


def load_adapter(peft_model: PeftModel, path: str | Path) -> None:
    """Load the adapter weights saved in checkpoint ``path`` into ``peft_model`` (exact: the same
    float tensors); every adapter tensor must be found.

    Raises:
        ConfigError: ``path`` holds no adapter (the run was not trained with ``model.lora``), or its
            adapter does not fit (another rank or other target modules).

    """
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = Path(path) / ADAPTER_WEIGHTS
    if not weights.exists():
        raise ConfigError(f"checkpoint {path} holds no LoRA adapter ({ADAPTER_WEIGHTS}): the run did not train "
                          "one; resume it with model.lora.rank = 0")
    try:
        result = set_peft_model_state_dict(peft_model, load_file(str(weights)))
    except RuntimeError as e:  # size mismatch: another rank
        raise ConfigError(f"checkpoint {path}: its adapter does not fit model.lora ({e}); resume with the run's "
                          "own [model.lora] settings") from e
    lost = [k for k in result.missing_keys if ".lora_" in k]
    if lost or result.unexpected_keys:
        raise ConfigError(f"checkpoint {path}: its adapter does not fit model.lora (missing {lost[:3]}, unexpected "
                          f"{list(result.unexpected_keys)[:3]}); resume with the run's own [model.lora] settings")


def export_merged(peft_model: PeftModel, tokenizer: PreTrainedTokenizerBase, out: str | Path) -> Path:
    """Fold the adapter into the base weights (W + (alpha / r) B A) and write a plain Hugging Face
    model (+ tokenizer) to ``out``, atomically (a temporary directory renamed into place).

    The merge is done in place, so no second copy of the model is held: the adapter is gone
    afterwards and the module is a plain model. Call it last, when training is over.
    """
    out = Path(out)
    merged = peft_model.merge_and_unload(safe_merge=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


class _Disabled(torch.nn.Module):
    """A submodule of a LoRA policy called with the adapter switched off."""

    def __init__(self, inner: torch.nn.Module, owner: AdapterDisabled) -> None:
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "_owner", owner)  # not a submodule: the owner holds this module

    def forward(self, *args: object, **kwargs: object) -> object:
        """``inner(*args, **kwargs)`` with the adapter off."""
        with self._owner.adapter_off():
            return self.inner(*args, **kwargs)


class AdapterDisabled(torch.nn.Module):
    """The reference model of a LoRA run: the policy module itself, run with its adapter switched
    off (peft's ``disable_adapter``), so the frozen base weights give the starting policy and no
    second copy is loaded.

    It answers what the log-prob code asks of a model: calling it (``forward``), ``get_decoder()``
    (a trunk whose calls run with the adapter off), ``get_output_embeddings()``, ``config`` and
    ``parameters()`` (the policy's: the device). Every call runs in eval mode and without gradient,
    and leaves the policy's mode as it was. Do not ``.eval()`` or ``.to()`` it: that would reach the
    policy.
    """

    def __init__(self, peft_model: PeftModel) -> None:
        super().__init__()
        self.base = peft_model.get_base_model()
        self.config = self.base.config
        object.__setattr__(self, "_peft", peft_model)  # not a submodule (it wraps self.base)

    @contextlib.contextmanager
    def adapter_off(self) -> Iterator[None]:
        """The context in which the shared module computes the base model."""
        was_training = self.base.training
        self.base.eval()
        try:
            with torch.no_grad(), self._peft.disable_adapter():
                yield
        finally:
            self.base.train(was_training)

    def forward(self, *args: object, **kwargs: object) -> object:
        """The base model's forward (the adapter off)."""
        with self.adapter_off():
            return self.base(*args, **kwargs)

    def get_base_model(self) -> torch.nn.Module:
        """The wrapped Hugging Face model, to read what its ``forward`` takes (call this module, not it)."""
        return self.base

    def get_decoder(self) -> torch.nn.Module:
        """The base model's trunk, called with the adapter off."""
        return _Disabled(self.base.get_decoder(), self)

    def get_output_embeddings(self) -> torch.nn.Module | None:
        """The output head: a plain linear layer unless ``lm_head`` is a target (then the log-prob
        code finds no plain head and calls :meth:`forward`).
        """
        return self.base.get_output_embeddings()
