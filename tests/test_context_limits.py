"""Context limits: max_context from a preset or an HF config.json, and every command that
refuses a prompt + output beyond it (one line on stderr, exit 2, nothing allocated)."""

from __future__ import annotations

import json

import attrs
import pytest

from pdgpu import cli as pdgpu_cli
from pdgpu import serve_cli
from pdgpu.checkpoint import inspect_checkpoint, save_checkpoint
from pdgpu.hf_config import CheckpointError, hf_config, spec_from_config
from pdgpu.model import build_model
from pdref.models import ProfileError, list_models, load_model, model_from_dict
from pdsim.cli import main as pdsim_main

PUBLISHED = {"qwen3-0.6b": 40960, "qwen3-4b": 40960, "llama-3.1-8b": 131072,
             "llama-3.1-70b": 131072, "qwen3-next-80b-a3b": 262144}


def _no_allocation(monkeypatch) -> None:
    """Building or loading a model fails the test: a refusal must come before it."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the context check")

    monkeypatch.setattr(pdgpu_cli, "build_model", refuse)
    monkeypatch.setattr(pdgpu_cli, "load_checkpoint", refuse)
    monkeypatch.setattr(serve_cli, "load_served_model", refuse)


def _one_line_refusal(capsys, code: int) -> str:
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "max_context" in err and "prompt + output must be <= max_context" in err, err
    return err


def test_every_preset_has_a_max_context_and_real_models_the_published_one():
    """Each shipped profile names its context; the real models' equal their config.json's."""
    for name in list_models():
        assert load_model(name).max_context is not None, name
    for name, context in PUBLISHED.items():
        assert load_model(name).max_context == context, name


def test_max_context_in_a_profile_must_be_a_positive_integer():
    """A profile's max_context of 0 or a string is refused naming the field."""
    base = {k: 4 for k in ("layers", "hidden", "heads", "kv_heads", "head_dim",
                           "intermediate", "vocab")}
    for bad in (0, "4096"):
        with pytest.raises(ProfileError, match="'max_context' must be an integer >= 1"):
            model_from_dict({**base, "arch": "qwen3", "dtype": "float32",
                             "max_context": bad}, "m", "m.toml")


def test_max_context_is_read_from_an_hf_config_and_written_back():
    """spec_from_config takes max_position_embeddings; hf_config writes it again."""
    config = hf_config(attrs.evolve(load_model("tiny"), max_context=256))
    assert config["max_position_embeddings"] == 256
    assert spec_from_config(config, "m", "config.json").max_context == 256
    del config["max_position_embeddings"]
    assert spec_from_config(config, "m", "config.json").max_context is None
    with pytest.raises(CheckpointError, match="'max_position_embeddings' must be an integer"):
        spec_from_config({**config, "max_position_embeddings": -1}, "m", "config.json")


@pytest.fixture
def short_checkpoint(tmp_path):
    """A tiny HF checkpoint whose config.json says max_position_embeddings 256."""
    folder = tmp_path / "short"
    save_checkpoint(build_model(attrs.evolve(load_model("tiny"), max_context=256)), folder)
    assert json.loads((folder / "config.json").read_text())["max_position_embeddings"] == 256
    assert inspect_checkpoint(folder).max_context == 256
    return str(folder)


def test_generate_refuses_a_prompt_beyond_a_checkpoints_context(short_checkpoint, capsys,
                                                                monkeypatch):
    """pdgpu generate: 400 prompt tokens on a 256-token checkpoint: one line, exit 2."""
    _no_allocation(monkeypatch)
    tokens = ",".join(["1"] * 400)
    code = pdgpu_cli.main(["generate", "--model", short_checkpoint, "--tokens", tokens])
    assert "400 + output 8 = 408" in _one_line_refusal(capsys, code)


def test_generate_counts_the_output_tokens_too(capsys, monkeypatch):
    """pdgpu generate on tiny (4096): a 3-token prompt asking 5000 tokens is refused."""
    _no_allocation(monkeypatch)
    code = pdgpu_cli.main(["generate", "--model", "tiny", "--tokens", "1,2,3",
                           "--output-tokens", "5000"])
    assert "'tiny'" in _one_line_refusal(capsys, code)


def test_run_refuses_a_prompt_beyond_the_presets_context(capsys, monkeypatch):
    """pdgpu run --prompt 5000 on tiny (max_context 4096): one line, exit 2."""
    _no_allocation(monkeypatch)
    code = pdgpu_cli.main(["run", "--model", "tiny", "--prompt", "5000", "--device", "cpu"])
    assert "prompt 5000" in _one_line_refusal(capsys, code)


def test_serve_refuses_the_prompt_ranges_upper_end(capsys, monkeypatch):
    """pdgpu serve --prompt-range 64:5000 on tiny: refused by its upper end, no process."""
    _no_allocation(monkeypatch)
    code = pdgpu_cli.main(["serve", "--model", "tiny", "--prompt-range", "64:5000"])
    assert "prompt-range" in _one_line_refusal(capsys, code)


def test_serve_refuses_a_prompts_file_line_beyond_a_checkpoints_context(
        short_checkpoint, tmp_path, capsys, monkeypatch):
    """pdgpu serve --prompts: a 300-token line on a 256-token checkpoint names its request."""
    _no_allocation(monkeypatch)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"req": "long", "tokens": [1] * 300}) + "\n")
    code = pdgpu_cli.main(["serve", "--model", short_checkpoint, "--prompts", str(prompts)])
    assert "request 'long'" in _one_line_refusal(capsys, code)


@pytest.mark.parametrize("argv", [
    ["run", "--prompt", "100000000"],
    ["run", "--prompt", "40000", "--output-tokens", "2000"],
    ["run", "--requests", "3", "--prompt-range", "512:50000"],
    ["sweep", "--prompts", "512,50000", "--chunks", "64", "--quiet"],
    ["explain", "--prompt", "50000"],
    ["demo", "--model", "tiny", "--prompt", "5000"],
], ids=["run", "run-output", "prompt-range", "sweep", "explain", "demo"])
def test_pdsim_refuses_prompts_beyond_the_models_context(argv, capsys):
    """pdsim run/sweep/explain/demo beyond max_context: one line, exit 2."""
    _one_line_refusal(capsys, pdsim_main(argv))


def test_pdsim_accepts_a_prompt_at_the_context_and_export_only_beyond_it(capsys):
    """Exactly max_context is fine; --no-compute (no positions) has no limit."""
    assert pdsim_main(["run", "--prompt", "40960", "--json"]) == 0
    assert pdsim_main(["run", "--prompt", "50000", "--no-compute", "--json"]) == 0
