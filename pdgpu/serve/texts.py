"""Text in and out for the HTTP front end: a checkpoint folder's `tokenizer.json` (through the
`tokenizers` library: the Rust tokenizer transformers itself uses, without transformers) and
the chat template of its `tokenizer_config.json` (rendered with jinja2 in a sandbox, as
transformers renders it). A preset, or a folder without `tokenizer.json`, takes token ids
only; its output text is the ids, each after a space (`token_ids` has them as numbers).
"""

from __future__ import annotations

import json
from pathlib import Path


class TextError(ValueError):
    """A text the model cannot take (no tokenizer, no chat template, a bad template)."""


def _token_text(value) -> str | None:
    """A special token in tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template(config: dict) -> str | None:
    """The chat template: a string, or a list of named ones (the `default`)."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _raise(message: str):
    from jinja2 import TemplateError
    raise TemplateError(message)


class Texts:
    def __init__(self, tokenizer=None, config: dict | None = None) -> None:
        self.tokenizer, config = tokenizer, config or {}
        self.chat_template = _template(config)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_id = tokenizer.token_to_id(self.eos_token) if tokenizer and \
            self.eos_token else None

    @classmethod
    def for_model(cls, model: str) -> Texts:
        """The folder's tokenizer and template; none for a preset or a folder without one."""
        folder = Path(model)
        path = folder / "tokenizer.json"
        if not folder.is_dir() or not path.is_file():
            return cls()
        from tokenizers import Tokenizer
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text("utf-8")) if config_path.is_file() else {}
        return cls(Tokenizer.from_file(str(path)), config if isinstance(config, dict) else {})

    @property
    def has_tokenizer(self) -> bool:
        return self.tokenizer is not None

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of `text` (`special`: with the tokenizer's own added tokens, e.g. BOS)."""
        if self.tokenizer is None:
            raise TextError("this model has no tokenizer (no tokenizer.json in its folder): "
                            "send the prompt as token ids")
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return "".join(f" {i}" for i in ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """The chat template rendered for `messages`, with the assistant's turn opened."""
        if self.chat_template is None:
            raise TextError("this model has no chat template (chat_template in "
                            "tokenizer_config.json): use /v1/completions")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise  # templates refuse a conversation with it
        try:
            text = env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=True, bos_token=self.bos_token or "",
                eos_token=self.eos_token or "")
        except TemplateError as e:
            raise TextError(f"the chat template cannot render these messages: {e}") from None
        return self.encode(text, special=False)  # the template wrote the special tokens
