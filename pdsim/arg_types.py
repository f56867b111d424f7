"""Argument types shared by pdsim's option modules (argparse `type=` callables)."""

from __future__ import annotations

import argparse


def int_range(text: str) -> tuple[int, int]:
    """`A:B` as two integers (their order is the caller's rule)."""
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be A:B with integers, got {text!r}") from None
    return lo, hi
