"""The help format the three command lines share: each option's default beside its help."""

from __future__ import annotations

import argparse
import textwrap


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already names its default.

    Flags, and options whose default is None (a value computed at run time), say what
    happens without them in their own help text instead.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not action.option_strings or action.nargs == 0 or "default" in text or any(
                default is absent for absent in (None, False, argparse.SUPPRESS)):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, tuple | list) else default
        if str(shown) == "":  # an empty list or text: "(default: )" would say nothing
            return text
        return f"{text} (default: {str(shown).replace('%', '%%')})"

    def _split_lines(self, text: str, width: int) -> list[str]:
        """argparse's wrapping, but never inside a hyphenated name (mistral-nemo-12b)."""
        text = self._whitespace_matcher.sub(" ", text).strip()
        return textwrap.wrap(text, width, break_on_hyphens=False)


def count(n: int, noun: str, plural: str | None = None) -> str:
    """ "1 request", "3 requests": a number with its noun in the right number."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


GIB = 2**30


def size(n: int) -> str:
    """Bytes as MiB below 1 GiB, else GiB: never a six-digit MiB figure."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / 2**20:.2f} MiB"


def metric_text(key: str, value) -> str:
    """One metric's value with its unit beside it, JSON words for null and booleans.

    Names follow contract.md: `_s` seconds, `bytes` in the name bytes, `_frac` a fraction,
    `_pct` percent, `gbps` GB/s.
    """
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    if not isinstance(value, int | float):
        return str(value)
    if key.endswith("_s"):
        return f"{value:.6f} s  ({value * 1e3:.3f} ms)" if value < 10 else f"{value:.3f} s"
    if "bytes" in key and isinstance(value, int):
        return f"{value} B  ({size(value)})"
    if key.endswith("_frac"):
        return f"{value:.4f}  ({100 * value:.1f} %)"
    if key.endswith("_pct"):
        return f"{value:.3g} %"
    if key.endswith("gbps"):
        return f"{value:g} GB/s"
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def format_metrics(metrics: dict, keys=None, width: int = 0) -> str:
    """`name: value unit` lines, in `keys` order (default: the dict's), names right-aligned
    to `width`."""
    keys = list(metrics) if keys is None else keys
    return "\n".join(f"{key:>{width}}: {metric_text(key, metrics.get(key))}" for key in keys)
