"""What every workload source shares (generated or read, workload.py; a trace file,
trace_file.py): the error a bad input raises, and the rule a request's prefix keeps."""

from __future__ import annotations


class WorkloadError(ValueError):
    """A workload input that breaks a rule; the message names the field."""


def checked_prefix(prefix: int, prompt: int, page_tokens: int) -> int:
    """`prefix`, a multiple of `page_tokens` in [0, prompt]; else WorkloadError."""
    if prefix < 0 or prefix > prompt or prefix % page_tokens:
        raise WorkloadError(
            f"--prefix must be a multiple of page_tokens={page_tokens} in [0, prompt={prompt}],"
            f" got {prefix}")
    return prefix
