"""Samples only a serving trace (`pdgpu serve`) gives: the decoder loop's own time between
two decode steps, with the span bytes it landed and the context bytes it admitted there.

Every event here is stamped by the decoder's clock (decode stages, land, admit, release), so
the gaps need no clock offset. A gap after which no request was running (all released) is
left out: the loop then waited for work, it did not work.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class GapSample:
    """The decoder's loop between two decode steps: seconds, bytes landed, bytes admitted."""

    duration: float
    land_bytes: int
    admit_bytes: int


def gap_samples(header, events) -> list[GapSample]:
    """One sample per pair of consecutive decode steps with requests running throughout."""
    per_token = header.geometry.bytes_per_token
    prompt, span_bytes, out = {}, {}, []
    running, prev_end, landed, admitted, emptied = 0, None, 0, 0, False
    for e in events:
        kind = e.kind
        if kind == "reserve":
            prompt[e.req] = e.prompt
        elif kind == "issue":
            span_bytes[e.span] = e.bytes
        elif kind == "land":
            landed += span_bytes.pop(e.span, 0)
        elif kind == "admit":
            admitted += prompt.get(e.req, 0) * per_token  # its context copied to decode
            running += 1
        elif kind == "release" and running > 0:
            running -= 1
            emptied = emptied or running == 0
        elif kind == "stage" and e.name == "decode":
            if prev_end is not None and not emptied and e.t >= prev_end:
                out.append(GapSample(e.t - prev_end, landed, admitted))
            prev_end, landed, admitted, emptied = e.end, 0, 0, False
    return out
