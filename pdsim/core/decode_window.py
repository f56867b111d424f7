"""(v3) The decode batch's KV on sliding layers: each row holds min(context, window) tokens
there, so a row whose context is under the window reads one token more each step until the
step its context reaches the window, then the window's. The decoder prices a step's
windowed tokens (Costs.decode_window_token_s) from `tokens`.
"""

from __future__ import annotations


class WindowedKV:
    """The windowed tokens the batch's rows hold, and which rows still widen."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.tokens = 0  # sum over the rows of min(context, window)
        self.widening = 0  # rows whose context is under the window
        self.filling: dict[int, int] = {}  # step index -> rows reaching the window at its end

    def hold(self, prompt: int, first: int) -> None:
        """A row joins holding `prompt` tokens; its first decode step is step `first`."""
        if prompt >= self.window:
            self.tokens += self.window
            return
        self.tokens += prompt
        self.widening += 1
        fill = self._fill_step(prompt, first)
        self.filling[fill] = self.filling.get(fill, 0) + 1

    def step_done(self, step: int) -> None:
        """Step `step` ended: every widening row holds one token more."""
        if self.widening:
            self.tokens += self.widening
            self.widening -= self.filling.pop(step, 0)

    def let_go(self, context: int, first: int, prompt: int) -> None:
        """A row counted as holding `context` tokens leaves (first step `first`, prompt
        `prompt`): its windowed tokens go, and one still under the window stops widening."""
        self.tokens -= min(context, self.window)
        if context >= self.window:
            return
        self.widening -= 1
        fill = self._fill_step(prompt, first)
        left = self.filling[fill] - 1
        if left:
            self.filling[fill] = left
        else:
            del self.filling[fill]

    def _fill_step(self, prompt: int, first: int) -> int:
        """The step after which a row of `prompt` tokens, first decoded in step `first`,
        holds the whole window (its context grows by one a step)."""
        return first + self.window - prompt - 1
