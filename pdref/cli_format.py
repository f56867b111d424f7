"""The help format the three command lines share: each option's default beside its help."""

from __future__ import annotations

import argparse


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
        return f"{text} (default: {str(shown).replace('%', '%%')})"


def count(n: int, noun: str, plural: str | None = None) -> str:
    """ "1 request", "3 requests": a number with its noun in the right number."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
