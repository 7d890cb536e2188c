import subprocess
import sys
import textwrap

import pytest
import torch

from posttrain.models import TinySpec, build_tiny, load_model, load_tokenizer
from posttrain.run.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_trainer_state,
    save_checkpoint,
)


@pytest.fixture
def model_and_tok(tmp_path):
    d = build_tiny(tmp_path / "m", TinySpec(hidden_size=32, intermediate_size=64, num_layers=1))
    return load_model(str(d)), load_tokenizer(str(d))


def test_save_load_round_trip_and_pruning(tmp_path, model_and_tok):
    model, tok = model_and_tok
    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        save_checkpoint(root, step, model, tok, {"loop": {"step": step}}, keep=2)
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000002", "step_000003"]
    latest = latest_checkpoint(root)
    assert latest.name == "step_000003"
    state = load_trainer_state(latest)
    assert state["step"] == 3 and state["loop"] == {"step": 3}
    again = load_model(str(latest))
    for (_, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b)


def test_corrupted_checkpoint_is_detected(tmp_path, model_and_tok):
    model, tok = model_and_tok
    path = save_checkpoint(tmp_path / "ckpt", 1, model, tok, {})
    with (path / "model.safetensors").open("r+b") as f:
        f.seek(200)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(CheckpointError, match="checksum"):
        load_trainer_state(path)


def test_full_disk_keeps_previous_checkpoint(tmp_path, model_and_tok):
    # A real write failure: RLIMIT_FSIZE makes the kernel refuse writes past 16 KiB (the model file
    # is ~45 KiB) with EFBIG, as a full disk refuses them with ENOSPC. A subprocess keeps the limit
    # from leaking into the test run.
    model, tok = model_and_tok
    model.save_pretrained(tmp_path / "m2")
    tok.save_pretrained(tmp_path / "m2")
    script = textwrap.dedent(f"""
        import resource, signal, sys
        from pathlib import Path
        from posttrain.models import load_model, load_tokenizer
        from posttrain.run.checkpoint import CheckpointError, save_checkpoint
        m, t = load_model("{tmp_path / "m2"}"), load_tokenizer("{tmp_path / "m2"}")
        root = Path("{tmp_path / "ckpt"}")
        save_checkpoint(root, 1, m, t, {{}})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, hard))
        try:
            save_checkpoint(root, 2, m, t, {{}})
        except CheckpointError as e:
            print("ERR", e)
            sys.exit(0)
        sys.exit(1)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "previous checkpoint" in out.stdout and "step_000001" in out.stdout
    root = tmp_path / "ckpt"
    assert latest_checkpoint(root).name == "step_000001"
    assert not list(root.glob("*.tmp-*"))  # no half-written directory left behind
    load_trainer_state(root / "step_000001")  # still verifies
