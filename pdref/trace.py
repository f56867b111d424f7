"""Reading and writing JSONL traces (contract versions 1 to 4), strictly: every malformed
line is TRACE-1."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import attrs
import orjson

from pdref import events as ev
from pdref.geometry import Geometry
from pdref.kinds import LayerKind
from pdref.outfile import create_beside
from pdref.violations import Violation

MAX_INT = 2**53


class _Bad(Exception):
    """A field that breaks the form rules; turned into TRACE-1 with the line number."""


def _int(v, name):
    if type(v) is not int or not 0 <= v < MAX_INT:
        raise _Bad(f"field {name!r} must be an integer in [0, 2**53), got {v!r}")
    return v


def _pos_int(v, name):
    if _int(v, name) < 1:
        raise _Bad(f"field {name!r} must be >= 1, got {v!r}")
    return v


def _num(v, name):
    if type(v) not in (int, float) or not math.isfinite(v) or not 0 <= v < MAX_INT:
        raise _Bad(f"field {name!r} must be a finite number in [0, 2**53), got {v!r}")
    return v


def _str(v, name):
    if type(v) is not str:
        raise _Bad(f"field {name!r} must be a string, got {v!r}")
    return v


def _name(v, name):
    if type(v) is str and v:
        return v
    if not _str(v, name):
        raise _Bad(f"field {name!r} must be a non-empty string")
    return v


def _range(v, name):
    if type(v) is list and len(v) == 2:  # fast path for the well-formed case
        a, b = v
        if type(a) is int and type(b) is int and 0 <= a <= b < MAX_INT:
            return (a, b)
    if type(v) is not list or len(v) != 2:
        raise _Bad(f"field {name!r} must be a two-element array [a, b], got {v!r}")
    a, b = _int(v[0], name), _int(v[1], name)
    if a > b:
        raise _Bad(f"field {name!r} is a range [{a}, {b}) with a > b")
    return (a, b)


def _pages(v, name):
    if type(v) is not list:
        raise _Bad(f"field {name!r} must be an array of page ids, got {v!r}")
    if v and not (all(type(p) is int for p in v) and 0 <= min(v) and max(v) < MAX_INT):
        for p in v:
            _int(p, name)  # names the first bad id
    return tuple(v)


def _span(v, name):
    if type(v) is str:
        return _name(v, name)
    return _int(v, name)


def _page_ids(v, name):
    """(v4) An array of page ids: integers, or (a producer's) non-empty strings."""
    if type(v) is not list:
        raise _Bad(f"field {name!r} must be an array of page ids, got {v!r}")
    return tuple(_span(p, name) for p in v)


def _bool(v, name):
    if type(v) is not bool:
        raise _Bad(f"field {name!r} must be true or false, got {v!r}")
    return v


def _opt(check):
    return lambda v, name: None if v is None else check(v, name)


_COMMON = (("t", _num, True), ("req", _name, True))
FIELDS: dict[str, tuple] = {
    "reserve": (("prompt", _int, True), ("prefix", _int, True), ("pages", _pages, True),
                ("producer", _name, False)),
    "computed": (("layers", _range, True), ("tokens", _range, True)),
    "issue": (("span", _span, True), ("layers", _range, True), ("tokens", _range, True),
              ("bytes", _int, True)),
    "land": (("span", _span, True),),
    "fail": (("span", _span, True), ("error", _str, True)),
    "reuse": (("tokens", _range, True),),
    "produced": (("token", _int, True),),
    "admit": (),
    "release": (),
    "abort": (("reason", _str, True),),
    "fence": (("span", _span, True),),
    "stage": (("name", _name, True), ("end", _num, True), ("span", _opt(_span), False),
              ("resource", _opt(_name), False), ("tokens", _opt(_range), False),
              ("batch", _opt(_pos_int), False), ("kv_tokens", _opt(_int), False)),
}
# Version 3 adds a reserve's state slot and the state span's flag (both optional).
FIELDS_V3 = {**FIELDS,
             "reserve": FIELDS["reserve"] + (("state_slot", _opt(_span), False),),
             "issue": FIELDS["issue"] + (("state", _bool, False),)}
# Version 4 adds the prefix cache: hits at reserve (the decoder's) and at computed (a
# producer's), and the cache and evict events.
FIELDS_V4 = {**FIELDS_V3,
             "reserve": FIELDS_V3["reserve"] + (("hit", _opt(_pages), False),),
             "computed": FIELDS["computed"] + (("hit", _opt(_page_ids), False),),
             "cache": (("tokens", _range, True), ("pages", _page_ids, True),
                       ("producer", _opt(_name), False)),
             "evict": (("pages", _page_ids, True), ("producer", _opt(_name), False))}
_GEOMETRY = (("layers", _pos_int), ("kv_heads", _pos_int), ("head_dim", _pos_int),
             ("dtype_bytes", _pos_int), ("page_tokens", _pos_int))
_HEADER_KEYS = {"kind", "version", "source", "mode", "geometry", "pool_pages", "max_pending"}


def _with_defaults(cls, spec):
    """(name, check, required, default) per field, in the event class's field order, so an
    event is built positionally (no keyword dict per line: the checker's hot path). The
    fields a version does not read are the class's last ones and keep their defaults."""
    fields = attrs.fields_dict(cls)
    out = tuple((name, check, required, fields[name].default) for name, check, required in spec)
    assert tuple(f[0] for f in out) == tuple(fields)[:len(out)], cls
    return out


def _specs(fields: dict) -> dict:
    return {kind: (ev.EVENT_TYPES[kind], _with_defaults(ev.EVENT_TYPES[kind], _COMMON + spec))
            for kind, spec in fields.items()}


_SPECS_V2 = _specs(FIELDS)
# Version 1 has no fence: there it is an unknown kind. Versions 1 and 2 do not read v3's
# fields (an extra field is an extension there, ignored as before).
_SPECS = {1: {k: v for k, v in _SPECS_V2.items() if k != "fence"}, 2: _SPECS_V2,
          3: _specs(FIELDS_V3), 4: _specs(FIELDS_V4)}


def _event_from(obj: dict, specs: dict):
    kind = obj.get("kind")
    cls, spec = specs.get(kind, (None, None)) if type(kind) is str else (None, None)
    if spec is None:
        known = [v for v, by_kind in _SPECS.items() if type(kind) is str and kind in by_kind]
        if known:
            have = next(v for v, by_kind in _SPECS.items() if by_kind is specs)
            raise _Bad(f"kind {kind!r} needs a version {known[0]} trace (this one is "
                       f"version {have})")
        raise _Bad(f"unknown kind {kind!r}")
    # Fields in order, so the first bad or missing one is reported; an optional field's
    # default passes its own check unchanged.
    try:
        return cls(*[check(obj[name] if required else obj.get(name, default), name)
                     for name, check, required, default in spec])
    except KeyError as missing:
        raise _Bad(f"{kind} needs field {missing.args[0]!r}") from None


def _header_from(obj: dict) -> ev.Header:
    if obj.get("kind") != "header":
        raise _Bad("line 1 must be the header")
    version = obj.get("version")
    if type(version) is not int or version not in ev.VERSIONS:
        raise _Bad(f"version must be 1, 2, 3 or 4, got {version!r}")
    mode = obj.get("mode")
    if mode not in ("whole", "chunk", "layer"):
        raise _Bad(f"mode must be whole, chunk or layer, got {mode!r}")
    geo = obj.get("geometry")
    if type(geo) is not dict:
        raise _Bad("header needs a 'geometry' object")
    fields = {k: check(geo.get(k, 16 if k == "page_tokens" else None), k) for k, check in _GEOMETRY}
    kinds = _kinds(geo.get("kinds"), fields["layers"]) if version >= 3 else None
    linear = kinds is not None and any(k.kind == "linear" for k in kinds)
    recurrent = geo.get("recurrent", linear)
    if type(recurrent) is not bool:
        raise _Bad(f"field 'recurrent' must be true or false, got {recurrent!r}")
    if kinds is not None and recurrent != linear:
        raise _Bad(f"field 'recurrent' must be {str(linear).lower()}: "
                   f"{'a' if linear else 'no'} layer is linear")
    extra = tuple(sorted((k, v) for k, v in obj.items() if k not in _HEADER_KEYS))
    return ev.Header(
        source=_str(obj.get("source", ""), "source"), mode=ev.Mode(mode),
        geometry=Geometry(**fields, recurrent=recurrent, kinds=kinds),
        pool_pages=_int(obj.get("pool_pages"), "pool_pages"),
        max_pending=_pos_int(obj.get("max_pending"), "max_pending"), version=version,
        extra=extra,
    )


def _kinds(value, layers: int) -> tuple[LayerKind, ...] | None:
    """(v3) The geometry's `kinds`: one object per layer, or None when absent."""
    if value is None:
        return None
    if type(value) is not list or len(value) != layers:
        raise _Bad(f"field 'kinds' must be an array of {layers} layer kinds, got {value!r}")
    out = []
    for i, item in enumerate(value):
        if type(item) is not dict or set(item) - {"kind", "window", "state_bytes"}:
            raise _Bad(f"kinds[{i}] must be an object with kind and its window or "
                       f"state_bytes, got {item!r}")
        try:
            out.append(LayerKind(item.get("kind"),
                                 _opt(_pos_int)(item.get("window"), f"kinds[{i}].window"),
                                 _opt(_pos_int)(item.get("state_bytes"),
                                                f"kinds[{i}].state_bytes")))
        except ValueError as e:
            raise _Bad(f"kinds[{i}]: {e}") from None
    return tuple(out)


def _load(raw: bytes) -> dict:
    # orjson is strict RFC 8259: NaN, Infinity, overflowing floats and bad UTF-8 are errors.
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise _Bad(f"line is not valid JSON or not UTF-8 ({e})") from None
    if type(obj) is not dict:
        raise _Bad("line is not a JSON object")
    return obj


def parse_lines(lines: Iterable[bytes]) -> Iterator[tuple[int, object]]:
    """(line number, Header or event) for each line; raises TRACE-1/TRACE-2 Violations.

    Also enforces the form rules that span lines: header first and once, t never decreases,
    a stage ends at or after it starts.
    """
    last_t = 0.0
    specs = _SPECS[ev.VERSION]
    for lineno, raw in enumerate(lines, 1):
        try:
            obj = _load(raw)
            if lineno == 1:
                header = _header_from(obj)
                specs = _SPECS[header.version]
                yield lineno, header
                continue
            if obj.get("kind") == "header":
                raise _Bad("a second header")
            event = _event_from(obj, specs)
        except _Bad as e:
            raise Violation("TRACE-1", str(e), line=lineno) from None
        if event.t < last_t:
            raise Violation("TRACE-2", f"t {event.t} is before the previous event's t {last_t}",
                            event, lineno)
        if event.kind == "stage" and event.end < event.t:
            raise Violation("TRACE-2", f"stage ends at {event.end}, before it starts at {event.t}",
                            event, lineno)
        last_t = event.t
        yield lineno, event


def read_trace(path: str | Path) -> Iterator[tuple[int, object]]:
    """Stream a trace file: (line number, Header or event); an empty file is TRACE-1."""
    with open(path, "rb") as f:
        seen = False
        for item in parse_lines(f):
            seen = True
            yield item
        if not seen:
            raise Violation("TRACE-1", "the file is empty: a header is needed", line=1)


def dumps(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)


class TraceWriter:
    """Writes a trace atomically: to a temporary file renamed into place on success only."""

    def __init__(self, path: str | Path, header: ev.Header) -> None:
        self.path = Path(path)
        self.header = header
        self._file = None
        self._tmp: str | None = None

    def __enter__(self) -> TraceWriter:
        fd, self._tmp = create_beside(self.path)  # mode 0666 & ~umask, like open() would
        self._file = os.fdopen(fd, "w", encoding="utf-8")
        self._file.write(dumps(ev.header_to_json(self.header)) + "\n")
        return self

    def write(self, event) -> None:
        self._file.write(dumps(ev.event_to_json(event)) + "\n")

    def __exit__(self, exc_type, exc, tb) -> None:
        self._file.close()
        if exc_type is None:
            os.replace(self._tmp, self.path)
        else:
            os.unlink(self._tmp)
