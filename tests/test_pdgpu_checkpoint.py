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
    ("config", dict(config_edit=lambda c: c.pop("hidden_size")), "missing field 'hidden_size'"),
    ("bias", dict(config_edit=lambda c: c.update(attention_bias=True)), "'attention_bias'"),
]


def _config(**changes):
    """An edit of config.json: set each key, or delete it where the value is DELETE."""
    def edit(config):
        for key, value in changes.items():
            if value is DELETE:
                config.pop(key)
            else:
                config[key] = value
    return dict(config_edit=edit)


DELETE = object()
ROPE_5 = {"rope_theta": 1e6, "rope_type": "default"}
LLAMA3_5 = {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0}  # original_max_position_embeddings left out
# Each field that changes the math: missing, contradictory or unsupported -> refused, named.
REFUSED = [
    ("no-rope-theta", _config(rope_theta=DELETE), "missing field 'rope_theta'"),
    ("no-rope-theta-5", _config(rope_theta=DELETE, rope_parameters={"rope_type": "default"}),
     "missing field 'rope_theta'"),
    ("two-thetas", _config(rope_theta=1e4, rope_parameters=ROPE_5), "field 'rope_theta'"),
    ("rope-yarn", _config(rope_theta=DELETE,
                                   rope_parameters={**ROPE_5, "rope_type": "yarn", "factor": 4}),
     "field 'rope_type' 'yarn'"),
    ("rope-linear-4", _config(rope_scaling={"type": "linear", "factor": 2.0}),
     "field 'rope_type' 'linear'"),
    ("llama3-field", _config(rope_theta=DELETE, rope_parameters=LLAMA3_5),
     "'original_max_position_embeddings'"),
    ("scaling-no-type", _config(rope_scaling={"factor": 2.0}), "missing field 'rope_type'"),
    ("partial-rope", _config(partial_rotary_factor=0.5), "'partial_rotary_factor'"),
    ("sliding", _config(use_sliding_window=True, sliding_window=64), "'use_sliding_window'"),
    ("layer-types", _config(layer_types=["full_attention", "sliding_attention"]),
     "'layer_types' has 'sliding_attention'"),
    ("mlp-bias", _config(mlp_bias=True), "'mlp_bias'"),
    ("gelu", _config(hidden_act="gelu"), "'hidden_act'"),
    ("no-act", _config(hidden_act=DELETE), "missing field 'hidden_act'"),
    ("no-eps", _config(rms_norm_eps=DELETE), "missing field 'rms_norm_eps'"),
    ("no-tie", _config(tie_word_embeddings=DELETE), "missing field 'tie_word_embeddings'"),
    ("no-dtype", _config(torch_dtype=DELETE), "missing field 'dtype'"),
    ("dtype-64", _config(torch_dtype=DELETE, dtype="float64"), "field 'dtype' 'float64'"),
    ("two-dtypes", _config(dtype="bfloat16"), "contradict"),
    ("qwen3-no-head-dim", _config(head_dim=DELETE), "missing field 'head_dim'"),
    ("qwen3-no-kv-heads", _config(num_key_value_heads=DELETE),
     "missing field 'num_key_value_heads'"),
    ("head-dim-vs-shapes", _config(head_dim=TINY.head_dim // 2), "field 'head_dim'"),
    ("model-type", _config(model_type="mistral"), "field 'model_type' 'mistral'"),
    ("two-archs", _config(architectures=["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]),
     "unknown architecture"),
]
BAD += REFUSED


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


def test_llama_may_leave_out_head_dim_and_kv_heads(tmp_path):
    """LlamaConfig's own rules (hidden/heads, no GQA) apply when a Llama config omits them."""
    spec = attrs.evolve(LLAMA, kv_heads=TINY.heads, head_dim=TINY.hidden // TINY.heads)
    _write(tmp_path / "m", spec, **_config(head_dim=DELETE, num_key_value_heads=DELETE))
    loaded = ckpt.inspect_checkpoint(tmp_path / "m")
    assert (loaded.head_dim, loaded.kv_heads) == (spec.head_dim, spec.heads)


def test_refused_config_is_exit_2_on_the_command_line(tmp_path, capsys):
    """`pdgpu run --model DIR` with a config missing rope_theta: one line naming it, exit 2."""
    from pdgpu.cli import main

    _write(tmp_path / "m", TINY, **_config(rope_theta=DELETE))
    assert main(["run", "--model", str(tmp_path / "m"), "--prompt", "16", "--chunk", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rope_theta" in err and "Traceback" not in err


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


# Checkpoints written by transformers itself (the dev extra installs it), in both layouts.
HF_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                initializer_range=0.2)
HF_MODELS = {
    # head_dim 32 != hidden / heads, tied head, theta far from the old 10000.0 fallback
    "qwen3": ("Qwen3", dict(head_dim=32, rope_theta=1e6, tie_word_embeddings=True)),
    # no head_dim (LlamaConfig derives it), llama3 frequency scaling, untied head
    "llama3": ("Llama", dict(rope_theta=5e5, tie_word_embeddings=False, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
}


def _as_transformers_4(config: dict) -> dict:
    """The same config in the transformers 4 layout: top-level rope_theta, rope_scaling,
    torch_dtype."""
    legacy = {k: v for k, v in config.items() if k not in ("rope_parameters", "dtype")}
    rope = dict(config["rope_parameters"])
    legacy["rope_theta"] = rope.pop("rope_theta")
    legacy["rope_scaling"] = rope if rope["rope_type"] == "llama3" else None
    legacy["torch_dtype"] = config["dtype"]
    return legacy


def _as_transformers_5(config: dict) -> dict:
    """The same config in the transformers 5 layout: rope_parameters, dtype."""
    new = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling",
                                                        "torch_dtype")}
    rope = {"rope_type": "default", **(config.get("rope_scaling") or {})}
    new["rope_parameters"] = {**rope, "rope_theta": config["rope_theta"]}
    new["dtype"] = config["torch_dtype"]
    return new


def _save_with_transformers(transformers, folder, family, fields, layout):
    """save_pretrained a seeded random model, its config.json in the given layout (4 or 5);
    returns the config in the transformers 5 layout."""
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**HF_SHAPE, **fields)
    getattr(transformers, f"{family}ForCausalLM")(config).save_pretrained(folder)
    written = json.loads((folder / "config.json").read_text())
    new = written if "rope_parameters" in written else _as_transformers_5(written)
    wanted = new if layout == "5" else _as_transformers_4(new)
    if wanted != written:  # installed transformers wrote the other layout
        (folder / "config.json").write_text(json.dumps(wanted))
    return new


def _pdgpu_logits(model, tokens):
    """Logits [n, V] of one prefill chunk through a paged source cache."""
    from pdgpu.source_cache import SourceCache

    cache = SourceCache(model.spec.geometry(8), 16, "cpu", torch.float32)
    return model.logits(model.prefill_chunk(tokens, 0, cache.open(len(tokens))))


@pytest.mark.parametrize("layout", ["5", "4"], ids=["rope_parameters", "top-level"])
@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_transformers_checkpoint_gives_transformers_logits(tmp_path, name, layout):
    """A checkpoint saved by transformers (either config layout) loads with its own rope
    settings, and gives transformers' logits and first token."""
    transformers = pytest.importorskip("transformers")
    family, fields = HF_MODELS[name]
    folder = tmp_path / name
    written = _save_with_transformers(transformers, folder, family, fields, layout)
    model = ckpt.load_checkpoint(folder)
    assert model.spec.rope_theta == written["rope_parameters"]["rope_theta"]
    assert (model.spec.rope_scaling is None) == (name == "qwen3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()
    tokens = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens[None]).logits[0]  # [n, V]
        got = _pdgpu_logits(model, tokens)  # [n, V]
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert int(got[-1].argmax()) == int(want[-1].argmax())
