"""`pdgpu serve --http` on the hybrid families (issue 33 item 4): a Qwen3.5 and a Gemma 3
checkpoint, each with a tokenizer and its family's chat template (ChatML; Gemma's turns after
a BOS), served through the official openai client: the chat and text
completions' tokens equal `pdgpu generate`'s on the rendered prompt. (A server starts in ~15 s
on a loaded 2-core box: Gemma 3's run is in the slow set.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
pytest.importorskip("tokenizers")
from serve_helpers import reference, trace_ok  # noqa: E402
from test_pdgpu_http import CHUNK, SENTENCES, Server, token_ids  # noqa: E402
from test_pdgpu_serve_hybrid import save_sensitive  # noqa: E402

# The families' templates as their checkpoints ship them, less what a plain conversation does
# not reach (tools, images, system-prompt folding).
TEMPLATES = {
    "qwen3_5": ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + "
                "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
                "{{ '<|im_start|>assistant\\n' }}{% endif %}"),
    "gemma3": ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m.role == "
               "'assistant' else m.role %}{{ '<start_of_turn>' + role + '\\n' + m.content | trim "
               "+ '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}"
               "{{ '<start_of_turn>model\\n' }}{% endif %}"),
}
SPECIAL = {"qwen3_5": {"eos_token": "<|im_end|>", "specials": ["<|im_start|>", "<|im_end|>"]},
           "gemma3": {"bos_token": "<bos>", "eos_token": "<end_of_turn>",
                      "specials": ["<bos>", "<start_of_turn>", "<end_of_turn>"]}}


def write_family_tokenizer(folder: Path, family: str, vocab: int = 256) -> None:
    """A WordLevel tokenizer over exactly `vocab` words, the family's special tokens (matched
    before the whitespace split, as in theirs) and its chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    special = SPECIAL[family]
    words = ["[UNK]", *special["specials"], "user", "model", "assistant"]
    words += [w for w in dict.fromkeys(" ".join(SENTENCES).split()) if w not in words]
    words += [f"w{i}" for i in range(vocab - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(special["specials"])
    tok.save(str(folder / "tokenizer.json"))
    config = {k: v for k, v in special.items() if k != "specials"}
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": TEMPLATES[family]}))


@pytest.mark.parametrize("family", ["qwen3_5", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_both_hybrids_serve_chat_and_text_with_their_templates(tmp_path, family):
    """Chat renders the family's template (Gemma's BOS and turns, Qwen's ChatML), text is
    tokenized as is: the served tokens are generate's on those ids, up to the tokenizer's
    end of turn; the trace is legal v4 (its kinds, and the prefix cache on by default) and
    nothing leaks."""
    folder = Path(save_sensitive(tmp_path / family, family))
    write_family_tokenizer(folder, family)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = tok.token_to_id(SPECIAL[family]["eos_token"])
    srv = Server(tmp_path, str(folder), "--mode", "chunk")
    try:
        client = srv.client()
        chat = client.chat.completions.create(
            model=srv.model_id, max_tokens=6, messages=[{"role": "user", "content": SENTENCES[0]}])
        text = client.completions.create(model=srv.model_id, max_tokens=6, prompt=SENTENCES[1])
    finally:
        code, values = srv.stop()
    rendered = (f"<|im_start|>user\n{SENTENCES[0]}<|im_end|>\n<|im_start|>assistant\n"
                if family == "qwen3_5" else
                f"<bos><start_of_turn>user\n{SENTENCES[0]}<end_of_turn>\n<start_of_turn>model\n")
    prompt = tok.encode(rendered, add_special_tokens=False).ids
    assert tok.token_to_id("[UNK]") not in prompt  # every word of the template is known
    assert token_ids(chat.choices[0]) == reference(str(folder), prompt, 6, CHUNK, 0, eos=eos)
    words = tok.encode(SENTENCES[1]).ids
    assert token_ids(text.choices[0]) == reference(str(folder), words, 6, CHUNK, 0, eos=eos)
    assert code == 143 and values["leaked_pages"] == 0, (code, values)
    lines = srv.trace.read_bytes().splitlines()
    trace_ok(lines)
    header = json.loads(lines[0])
    assert header["version"] == 4 and header["prefix_cache"] and header["geometry"]["kinds"]
