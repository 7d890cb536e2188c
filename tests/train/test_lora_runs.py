"""RL runs with a LoRA adapter ([model.lora]): the checkpoint holds the adapter, the reference is
the base with the adapter off, the merged export, clear errors, exact resume after kill -9."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from posttrain.config import ConfigError
from posttrain.models.load import load_model, load_tokenizer
from posttrain.run.setup import run_dir_model
from posttrain.train.rl import train

needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")
LORA = ("model.lora.rank=4", "model.lora.alpha=8")
# partial_answer scores the digits a random tiny model gets right, so groups differ and the adapter moves
SIGNAL = 'reward=[{name="partial_answer"}]'
TIMING = ("time/", "throughput/")


def rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def strip_timing(r):
    return {k: v for k, v in r.items() if not k.startswith(TIMING)}


@needs_peft
def test_lora_run_checkpoints_the_adapter_and_its_reference_is_the_base(tiny_cfg, quiet, tmp_path):
    cfg = tiny_cfg(*LORA, SIGNAL, "train.steps=3", "checkpoint.every=0", "algorithm.kl_coef=0.1",
                   "model.lora.merge_on_export=true")
    train(cfg, console=quiet)
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_000003"
    names = {p.name for p in ckpt.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "trainer_state.pt"} <= names
    assert "model.safetensors" not in names  # no copy of the base weights
    adapter = load_file(ckpt / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    assert any(float(v.abs().max()) > 0 for k, v in adapter.items() if "lora_B" in k)  # B moved off 0
    kls = [r["policy/kl_ref"] for r in rows(run)]
    assert kls[0] == 0.0 and kls[-1] > 0  # at B = 0 the policy is the reference, then it moves away
    # the merged export and the adapter checkpoint (and the run directory) are the same plain model
    tok = load_tokenizer(str(run / "merged"))
    ids = torch.tensor([tok("12+34=64", add_special_tokens=False)["input_ids"]])
    merged, from_ckpt = load_model(str(run / "merged")), load_model(run_dir_model(str(run)))
    base = load_model(str(run / "base_model"))
    with torch.no_grad():
        want = merged(input_ids=ids).logits
        assert torch.allclose(from_ckpt(input_ids=ids).logits, want, atol=1e-5)
        assert not torch.allclose(base(input_ids=ids).logits, want, atol=1e-5)


@needs_peft
def test_target_modules_the_model_lacks_fail_before_training(tiny_cfg, quiet):
    cfg = tiny_cfg(*LORA, 'model.lora.target_modules=["q_proj", "query_key_value"]')
    with pytest.raises(ConfigError, match=r"model.lora.target_modules: \['query_key_value'\].*gate_proj"):
        train(cfg, console=quiet)


def test_lora_without_peft_says_how_to_install_it(tiny_cfg, quiet, tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'posttrain\[peft\]'"):
        train(tiny_cfg(*LORA), console=quiet)
    assert not (tmp_path / "run").exists()  # before the run directory or any model


@needs_peft
def test_resuming_an_adapter_checkpoint_needs_the_lora_settings(tiny_cfg, quiet):
    train(tiny_cfg(*LORA, "train.steps=1", "checkpoint.every=0"), console=quiet)
    with pytest.raises(ConfigError, match="holds a LoRA adapter"):
        train(tiny_cfg("train.steps=2"), resume=True, console=quiet)


@needs_peft
def test_lora_resume_after_kill_9_equals_uninterrupted(tmp_path):
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    common = ["--max-steps", "8", "log.progress=false", "checkpoint.every=3", *LORA, SIGNAL,
              "algorithm.kl_coef=0.05", "model.lora.dropout=0.1"]  # dropout: the RNG state must resume too
    cmd = [sys.executable, "-m", "posttrain.cli", "train", "recipes/tiny.toml"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    subprocess.run([*cmd, "--out", str(ref), *common], check=True, cwd=root, capture_output=True)
    # the same run, killed with SIGKILL once it has passed the step-3 checkpoint
    proc = subprocess.Popen(
        [*cmd, "--out", str(cut), *common], cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    metrics = cut / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(metrics.read_text().splitlines()) < 8, "the run finished before it could be killed"
    subprocess.run([*cmd, "--out", str(cut), "--resume", *common], check=True, cwd=root, capture_output=True)
    a, b = rows(ref), rows(cut)
    assert [r["step"] for r in b] == list(range(1, 9))
    for x, y in zip(a, b, strict=True):
        assert strip_timing(x) == strip_timing(y)
    wa = load_file(ref / "checkpoints" / "step_000008" / "adapter_model.safetensors")
    wb = load_file(cut / "checkpoints" / "step_000008" / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(float(v.abs().max()) > 0 for k, v in wa.items() if "lora_B" in k)  # the adapter trained
