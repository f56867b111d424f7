"""pdgpu.checkpoint: HF-layout round trip, and each bad checkpoint refused before allocation."""

from __future__ import annotations

import json

import attrs
import pytest
import torch
from safetensors.torch import save_file

from pdgpu import checkpoint as ckpt
from pdgpu.model import build_model
from pdref.models import RopeScaling, load_model

TINY = attrs.evolve(load_model("tiny"), dtype="float32")
LLAMA = attrs.evolve(TINY, arch="llama", tie_embeddings=False,
                     rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64))


def _write(folder, spec, seed=0, edit=None, config_edit=None):
    """Save a seeded model of `spec` in HF layout, after optional edits of tensors/config."""
    model = build_model(spec, seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if edit:
        edit(tensors)
    config = ckpt.hf_config(spec)
    if config_edit:
        config_edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return model


@pytest.mark.parametrize("spec", [TINY, LLAMA], ids=["qwen3-tied", "llama-untied"])
def test_round_trip_gives_identical_weights_and_spec(tmp_path, spec):
    """A saved model loads back with the same spec fields and bit-identical tensors."""
    model = _write(tmp_path / "m", spec, seed=4)
    loaded = ckpt.load_checkpoint(tmp_path / "m")
    assert attrs.evolve(loaded.spec, name=spec.name, source="") == attrs.evolve(spec, source="")
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_hf_names_are_the_published_ones():
    """The expected tensor names are Hugging Face's for Qwen3 (q_norm) and Llama (lm_head)."""
    qwen, llama = ckpt.expected_shapes(TINY), ckpt.expected_shapes(LLAMA)
    assert qwen["model.layers.1.self_attn.q_norm.weight"] == (TINY.head_dim,)
    assert "lm_head.weight" not in qwen
    assert llama["lm_head.weight"] == (TINY.vocab, TINY.hidden)
    assert "model.layers.0.self_attn.k_norm.weight" not in llama


def test_split_files_load(tmp_path):
    """Tensors spread over several .safetensors files load like one file."""
    model = build_model(TINY, seed=1)
    folder = tmp_path / "m"
    folder.mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    save_file({k: state[k] for k in names[::2]}, str(folder / "a.safetensors"))
    save_file({k: state[k] for k in names[1::2]}, str(folder / "b.safetensors"))
    (folder / "config.json").write_text(json.dumps(ckpt.hf_config(TINY)))
    loaded = ckpt.load_checkpoint(folder)
    assert torch.equal(loaded.model.norm.weight, model.model.norm.weight)


def _drop(name):
    return lambda t: t.pop(name)


def _reshape(name):
    return lambda t: t.__setitem__(name, t[name][:-1].contiguous())


def _add(name):
    return lambda t: t.__setitem__(name, torch.zeros(3))


BAD = [
    ("missing", dict(edit=_drop("model.layers.1.mlp.down_proj.weight")),
     "missing tensor model.layers.1.mlp.down_proj.weight"),
    ("misshapen", dict(edit=_reshape("model.layers.0.self_attn.k_proj.weight")),
     "tensor model.layers.0.self_attn.k_proj.weight has shape"),
    ("unexpected", dict(edit=_add("model.layers.0.extra.weight")),
     "unexpected tensor model.layers.0.extra.weight"),
    ("arch", dict(config_edit=lambda c: c.update(architectures=["GPT2LMHeadModel"])),
     "unknown architecture"),
    ("config", dict(config_edit=lambda c: c.pop("hidden_size")), "'hidden'"),
    ("bias", dict(config_edit=lambda c: c.update(attention_bias=True)), "attention_bias"),
]


@pytest.mark.parametrize("case,kwargs,message", BAD, ids=[b[0] for b in BAD])
def test_bad_checkpoint_fails_with_one_line_before_allocating(tmp_path, monkeypatch, case,
                                                               kwargs, message):
    """Each defect raises CheckpointError naming it, and no model is ever built."""
    _write(tmp_path / "m", TINY, **kwargs)
    built = []
    monkeypatch.setattr(ckpt, "build_model", lambda *a, **k: built.append(1))
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.load_checkpoint(tmp_path / "m")
    assert message in str(info.value)
    assert "\n" not in str(info.value)
    assert built == []


def test_not_safetensors_and_no_folder_are_refused(tmp_path):
    """A pickle-looking file is never unpickled; a missing folder is named."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(ckpt.hf_config(TINY)))
    (folder / "model.safetensors").write_bytes(b"\x80\x04not really")
    with pytest.raises(ckpt.CheckpointError, match="not a readable safetensors"):
        ckpt.load_checkpoint(folder)
    with pytest.raises(ckpt.CheckpointError, match="not a checkpoint folder"):
        ckpt.load_checkpoint(tmp_path / "absent")
