"""Output tokens to text one token at a time, giving out only text that can no longer change,
and all of it at the end: the pieces always join to the tokenizer's decode of the ids.

Text grows by decoding a short window (vLLM's incremental detokenizing): the tokens from
`start` decoded, minus those up to `read` decoded, is what the later tokens added (decoding the
whole output at every token would cost O(n^2) in the HTTP thread; decoding one token alone
loses a tokenizer's context, e.g. a leading space). A byte-level tokenizer decodes bytes with
U+FFFD for each bad or unfinished sequence; only the last U+FFFD can still change (the next
bytes may finish its character), every character before it is final: that one character is
held back until a later token settles it, or `flush` gives it as it is.
"""

from __future__ import annotations

from pdgpu.serve.texts import Texts

REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, texts: Texts) -> None:
        self.texts = texts
        self.ids: list[int] = []
        self.start = self.read = 0  # the window: ids[start:read] were decoded to `before`
        self.given = 0  # characters given past `before` in the current window

    def add(self, token: int) -> str:
        """The text that is final once `token` is added (maybe "")."""
        self.ids.append(token)
        if not self.texts.has_tokenizer:  # ids as text: nothing spans two tokens
            return self.texts.decode([token])
        before, after = self._window()
        settled = len(after) - after.endswith(REPLACEMENT)
        piece = after[len(before) + self.given:settled]
        if settled == len(after) and len(after) > len(before):  # a clean end: a new window
            self.start, self.read, self.given = self.read, len(self.ids), 0
        else:
            self.given += len(piece)
        return piece

    def flush(self) -> str:
        """The output ended: the text held back, as the tokenizer decodes it."""
        if not self.texts.has_tokenizer:
            return ""
        before, after = self._window()
        piece = after[len(before) + self.given:]
        self.start = self.read = len(self.ids)
        self.given = 0
        return piece

    def _window(self) -> tuple[str, str]:
        window = self.ids[self.start:]
        return self.texts.decode(window[:self.read - self.start]), self.texts.decode(window)
