"""The worker extension vLLM mixes into its workers for :class:`posttrain.rollout.vllm_engine.VLLMEngine`.

vLLM imports it by its dotted path (``worker_extension_cls``) inside the worker; its methods are what
``LLM.collective_rpc`` calls. It imports nothing from vLLM itself.
"""

from __future__ import annotations

from safetensors.torch import load


class WeightSync:
    """``posttrain_reload(blob)``: replace the worker's model weights with a safetensors blob."""

    def posttrain_reload(self, blob: bytes) -> None:
        """Load every tensor of ``blob`` (Hugging Face names) through vLLM's layer-wise
        ``reload_weights``, which re-runs the weight post-processing (the CPU backend re-packs every
        linear layer; a plain ``load_weights`` into the packed layers fails).
        """
        weights = load(blob)
        self.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
