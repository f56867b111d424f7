"""Random legal traces always check ok; single-edit mutants are refused with the right code;
the reader is strict (every malformed line is TRACE-1 with its line number, never a crash)."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from legal_helpers import first_problem
from vacuity_helpers import Vacuity

from pdref import events as ev
from pdref.check import check_file, check_lines
from pdref.geometry import Geometry
from pdref.synth import SynthConfig, synth_trace
from pdref.trace import TraceWriter, dumps, parse_lines
from pdref.violations import CODES

PT = 4
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
EACH = settings(SETTINGS, max_examples=25)  # for tests parametrized by event kind or edit
# pdref.synth draws no prefix cache: version 4's events are mutated in test_pdref_cache.py
KINDS = sorted(set(ev.EVENT_TYPES) - {"cache", "evict"})
VACUOUS = Vacuity()


@pytest.fixture(scope="module", autouse=True)
def _few_vacuous_examples():
    """After the module: no property may have mostly tested nothing."""
    yield
    VACUOUS.check()


@st.composite
def legal_traces(draw, need=None, **force):
    """(header, events) of random legal traffic: either version, any mode, failures,
    cancellations and fences (v2), retries, prefixes. `force` replaces the strategy of a
    setting (so that the traffic can hold what a property needs); with `need`, a predicate on
    the trace's JSON objects, other seeds of the same traffic are tried until one has it."""
    def pick_(name, strategy):
        return draw(force.get(name, strategy))

    mode = pick_("mode", st.sampled_from(["whole", "chunk", "layer"]))
    layers = draw(st.integers(1, 4))
    max_live = pick_("max_live", st.integers(1, 3))
    max_prompt = pick_("max_prompt", st.integers(1, 40))
    geo = Geometry(layers=layers, kv_heads=draw(st.integers(1, 2)), head_dim=2, dtype_bytes=2,
                   page_tokens=PT, recurrent=mode != "layer" and draw(st.booleans()))
    pool = max_live * -(-max_prompt // PT) + draw(st.integers(0, 4))
    header = ev.Header("test", mode, geo, pool, draw(st.integers(1, 3)),
                       version=pick_("version", st.sampled_from(ev.VERSIONS)))
    config = SynthConfig(
        requests=pick_("requests", st.integers(1, 6)), max_live=max_live,
        max_prompt=max_prompt, chunk=draw(st.integers(1, 16)),
        fail_rate=pick_("fail_rate", st.sampled_from([0.0, 0.1, 0.3])),
        retry_rate=draw(st.sampled_from([0.0, 0.7, 1.0])),
        prefix_rate=pick_("prefix_rate", st.sampled_from([0.0, 0.3, 0.8])),
        stages=pick_("stages", st.booleans()), producers=draw(st.integers(1, 2)),
        cancel_rate=pick_("cancel_rate", st.sampled_from([0.0, 0.1, 0.4])))
    seed = draw(st.integers(0, 2**32))
    for tries in range(40 if need else 1):
        events = synth_trace(header, config, seed + tries)
        if need is None or need(to_objs(header, events)):
            return header, events
    assume(False)  # rare: the forced settings make what `need` wants in most seeds


# Settings under which the synthetic traffic can hold each event kind or edit site at all.
FAILS = {"fail_rate": st.sampled_from([0.1, 0.3])}
FORCE = {
    "fail": FAILS, "abort": FAILS, "fence": {**FAILS, "version": st.just(2)},
    "stage": {"stages": st.just(True)}, "stage-end": {"stages": st.just(True)},
    "reuse": {"prefix_rate": st.sampled_from([0.3, 0.8])},
    "pages-held": {"max_live": st.integers(2, 3), "requests": st.integers(3, 6)},
    "pages-dup": {"max_prompt": st.integers(PT + 1, 40)},
}


def traces_with(name, sites):
    """Legal traces in which `sites(objs)` (the indices a property can edit) is not empty."""
    return legal_traces(need=lambda objs: bool(sites(objs)), **FORCE.get(name, {}))


def test_vacuity_check_fails_when_most_examples_tested_nothing():
    """The module's guard fails a property whose examples mostly returned early, not others."""
    vac = Vacuity()
    for n in range(10):
        vac.tally("mostly-empty", n < 4)
        vac.tally("fine", n != 0)
    with pytest.raises(AssertionError, match="mostly-empty 60%"):
        vac.check()
    assert vac.rates() == {"fine": 0.1, "mostly-empty": 0.6}


def to_objs(header, events) -> list[dict]:
    return [ev.header_to_json(header)] + [ev.event_to_json(e) for e in events]


def to_lines(objs) -> list[bytes]:
    return [(dumps(o) + "\n").encode() for o in objs]


def check(objs, **kw):
    return check_lines(to_lines(objs), **kw)


def assert_sane(result, n_lines):
    """Whatever the input, the checker answers with a verdict, never a crash."""
    if not result.ok:
        assert result.code in CODES
        assert 1 <= result.line <= max(n_lines, 1)
        assert result.message


# --- legal traces --------------------------------------------------------------------------


@SETTINGS
@given(legal_traces())
def test_legal_traces_check_ok(trace):
    """Every synthetic trace checks ok, counting its events and requests; the independent
    reading of the contract (legal_helpers, no pdref code) finds no problem either."""
    header, events = trace
    result = check(to_objs(header, events))
    assert result.ok, result.text()
    assert first_problem(to_lines(to_objs(header, events))) is None
    assert result.events == len(events)
    assert result.requests == len({e.req for e in events if e.kind == "reserve"})


@SETTINGS
@given(legal_traces())
def test_serialized_trace_reads_back_equal(trace):
    """Writing a trace as JSONL and parsing it gives back the same header and events."""
    header, events = trace
    parsed = [item for _, item in parse_lines(to_lines(to_objs(header, events)))]
    assert parsed[0].mode == header.mode and parsed[0].geometry == header.geometry
    assert parsed[1:] == events


def test_trace_writer_output_checks_ok(tmp_path):
    """A trace written by TraceWriter checks ok from disk, and a failed write leaves nothing."""
    header = ev.Header("t", "chunk", Geometry(2, 1, 2, 2, PT), 30, 2)
    events = synth_trace(header, SynthConfig(requests=5, max_live=2, max_prompt=40), 3)
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, header) as w:
        for e in events:
            w.write(e)
    result = check_file(path)
    assert result.ok and result.events == len(events)
    with pytest.raises(RuntimeError), TraceWriter(tmp_path / "no.jsonl", header) as w:
        w.write(events[0])
        raise RuntimeError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]


# --- single-edit mutants -------------------------------------------------------------------


def lives(objs):
    """For each event index, the index of the reserve that opened its life (None if none)."""
    owner, live = {}, {}
    for i, o in enumerate(objs[1:], 1):
        if o["kind"] == "reserve":
            live[o["req"]] = i
        owner[i] = live.get(o["req"])
        if o["kind"] in ("release", "abort"):
            live.pop(o["req"], None)
    return owner


def later(objs, i, pred):
    """Index of the first event after i of the same life that satisfies pred, or None."""
    owner = lives(objs)
    for j in range(i + 1, len(objs)):
        if owner.get(j) == owner[i] and objs[j]["req"] == objs[i]["req"] and pred(objs[j]):
            return j
    return None


def kind_sites(kinds, extra=lambda o: True):
    """The sites of a property that edits one event of `kinds` (a kind or a set of kinds)."""
    kinds = {kinds} if isinstance(kinds, str) else kinds
    return lambda objs: [i for i, o in enumerate(objs) if i and o["kind"] in kinds and extra(o)]


def edited(data, name, sites):
    """(objs, i): a legal trace made to hold a site of property `name`, and one site drawn
    from it (None only if no seed gave one, which `legal_traces` rejects first)."""
    objs = to_objs(*data.draw(traces_with(name, sites), "trace"))
    idx = sites(objs)
    return objs, (data.draw(st.sampled_from(idx), "site") if idx else None)


def verdict(objs):
    result = check(objs)
    assert_sane(result, len(objs))
    return result


@pytest.mark.parametrize("kind", KINDS)
@EACH
@given(data=st.data())
def test_duplicated_event(kind, data):
    """A duplicated event: idempotent kinds stay legal, the others break a certain rule."""
    objs, i = edited(data, kind, kind_sites(kind))
    if not VACUOUS.tally(f"duplicated[{kind}]", i is not None):
        return
    mutant = objs[:i + 1] + [copy.deepcopy(objs[i])] + objs[i + 1:]
    result = verdict(mutant)
    want = {"reserve": "REQ-1", "issue": "REQ-1", "land": "REQ-1", "fail": "REQ-1",
            "release": "REQ-1", "abort": "REQ-1", "produced": "PROD-1", "admit": "ADM-1",
            "fence": "REQ-1"}
    if kind in want:
        assert (result.code, result.line) == (want[kind], i + 2), result.text()
    else:  # computed, reuse, stage: applying twice is applying once
        assert result.ok, result.text()


@pytest.mark.parametrize("kind", KINDS)
@EACH
@given(data=st.data())
def test_deleted_event(kind, data):
    """A deleted event is legal or refused; where the broken rule is certain, with its code."""
    objs, i = edited(data, kind, kind_sites(kind))
    if not VACUOUS.tally(f"deleted[{kind}]", i is not None):
        return
    mutant = objs[:i] + objs[i + 1:]
    result = verdict(mutant)

    def line_of(j):  # line of old index j > i in the mutant
        return j if j is not None else None

    if kind == "reserve":
        # a fence may name a span of the request's ended life: legal with no life live
        j = later(objs, i, lambda x: x["kind"] not in ("stage", "fence"))
        assert (result.code, result.line) == ("REQ-1", line_of(j)), result.text()
    elif kind == "admit":
        j = later(objs, i, lambda x: x["kind"] == "release")
        assert (result.code, result.line) == ("LIFE-1", line_of(j)), result.text()
    elif kind == "produced":
        j = later(objs, i, lambda x: x["kind"] == "admit")
        if j is None:
            assert result.ok, result.text()
        else:
            assert (result.code, result.line) == ("ADM-1", line_of(j)), result.text()
    elif kind == "computed":
        if later(objs, i, lambda x: x["kind"] == "produced") is not None:
            assert result.code in ("PROD-1", "COPY-1"), result.text()
    elif kind == "land":
        if later(objs, i, lambda x: x["kind"] == "admit") is not None:
            assert result.code in ("ADM-1", "COPY-2", "COPY-3"), result.text()
    elif kind == "release":
        if objs[lives(objs)[i]]["pages"]:
            assert result.code in ("LIFE-1", "SLAB-1"), result.text()
    elif kind == "issue":
        j = later(objs, i, lambda x: x["kind"] in ("land", "fail")
                  and x["span"] == objs[i]["span"])
        fence = next((k for k in range(i + 1, len(objs)) if objs[k]["kind"] == "fence"
                      and objs[k]["span"] == objs[i]["span"]), None)
        if j is None and fence is None:  # cancelled by an abort (v1: no fence)
            assert result.ok, result.text()
        elif j is None:  # v2: the cancelled span's fence now names a span never issued
            assert (result.code, result.line) == ("REQ-1", line_of(fence)), result.text()
        else:
            assert (result.code, result.line) == ("REQ-1", line_of(j)), result.text()
    elif kind == "fence":  # the writer never stopped: its slot, pages or the end say so
        assert result.code in ("COPY-5", "COPY-2", "LIFE-1"), result.text()
    elif kind in ("stage", "reuse"):  # informational; or: more source KV held is never worse
        assert result.ok, result.text()


@SETTINGS
@given(legal_traces(), st.data())
def test_swapped_adjacent_events(trace, data):
    """Two adjacent events swapped: a verdict; causally ordered pairs and t going back refused."""
    objs = to_objs(*trace)
    if not VACUOUS.tally("swapped", len(objs) >= 3):
        return
    i = data.draw(st.integers(1, len(objs) - 2))
    a, b = objs[i], objs[i + 1]
    mutant = objs[:i] + [b, a] + objs[i + 2:]
    result = verdict(mutant)
    if a["req"] == b["req"] and a.get("span") == b.get("span") and (a["kind"], b["kind"]) in {
            ("reserve", "computed"), ("reserve", "issue"), ("issue", "land"), ("issue", "fail"),
            ("admit", "release"), ("produced", "admit")}:
        assert not result.ok and result.line == i + 1, result.text()
    if a["t"] < b["t"]:
        assert not result.ok and result.line <= i + 2
        if result.line == i + 2:
            assert result.code == "TRACE-2"


EDITS = ["t-back", "stage-end", "req", "issue-bytes", "issue-layers", "issue-tokens", "land-span",
         "prefix", "pages-drop", "pages-extra", "pages-outside", "pages-dup", "pages-held",
         "shrink-span"]


def held_before(objs) -> dict[int, set]:
    """For each event index, the pages held by live slabs just before it."""
    held, held_at = {}, {}
    for j, o in enumerate(objs[1:], 1):
        held_at[j] = {p for pages in held.values() for p in pages}
        if o["kind"] == "reserve":
            held[o["req"]] = o["pages"]
        elif o["kind"] in ("release", "abort"):
            held.pop(o["req"], None)
    return held_at


def _held_sites(objs):
    held_at = held_before(objs)
    return [i for i in kind_sites("reserve")(objs) if objs[i]["pages"] and held_at[i]]


EDIT_SITES = {  # edit -> the indices of a trace where it breaks its rule for certain
    "t-back": lambda objs: [i for i in range(2, len(objs)) if objs[i - 1]["t"] > 0],
    "stage-end": kind_sites("stage", lambda o: o["t"] > 0),
    "req": kind_sites(set(ev.EVENT_TYPES) - {"reserve", "stage"}),
    "issue-bytes": kind_sites("issue"), "issue-layers": kind_sites("issue"),
    "issue-tokens": kind_sites("issue"), "land-span": kind_sites({"land", "fail"}),
    "prefix": kind_sites("reserve"), "pages-drop": kind_sites("reserve", lambda o: o["pages"]),
    "pages-extra": kind_sites("reserve"),
    "pages-outside": kind_sites("reserve", lambda o: o["pages"]),
    "pages-dup": kind_sites("reserve", lambda o: len(o["pages"]) >= 2),
    "pages-held": _held_sites,
    "shrink-span": kind_sites("issue", lambda o: o["tokens"][1] > o["tokens"][0]),
}


@pytest.mark.parametrize("edit", EDITS)
@EACH
@given(data=st.data())
def test_changed_field(edit, data):
    """One field changed so that a certain rule breaks: refused with that code at that line."""
    objs, i = edited(data, edit, EDIT_SITES[edit])
    if not VACUOUS.tally(f"changed[{edit}]", i is not None):
        return
    header = objs[0]
    layers = header["geometry"]["layers"]
    m = copy.deepcopy(objs)
    owner = lives(objs)
    if edit == "t-back":
        m[i]["t"] = objs[i - 1]["t"] / 2
        want = "TRACE-2"
    elif edit == "stage-end":
        m[i]["end"] = objs[i]["t"] / 2
        want = "TRACE-2"
    elif edit == "req":
        m[i]["req"] = "nobody"
        want = "REQ-1"
    elif edit == "issue-bytes":
        m[i]["bytes"] = objs[i]["bytes"] + data.draw(st.sampled_from([-1, 1, 7, 1000]))
        if m[i]["bytes"] < 0:
            m[i]["bytes"] = 1
        want = "COPY-4"
    elif edit == "issue-layers":
        m[i]["layers"] = [objs[i]["layers"][0], layers + 1]
        want = "COV-1"
    elif edit == "issue-tokens":
        prompt = objs[owner[i]]["prompt"]
        m[i]["tokens"] = [objs[i]["tokens"][0], prompt + data.draw(st.integers(1, 3))]
        want = "COV-1"
    elif edit == "land-span":
        m[i]["span"] = "never-issued"
        want = "REQ-1"
    elif edit == "prefix":
        m[i]["prefix"] = objs[i]["prefix"] + data.draw(st.integers(1, PT - 1))
        want = "SLAB-2"
    elif edit.startswith("pages"):
        pages = list(objs[i]["pages"])
        if edit == "pages-drop":
            pages.pop(data.draw(st.integers(0, len(pages) - 1)))
        elif edit == "pages-extra":
            pages.append(max(pages, default=0) + 1)
        elif edit == "pages-outside":
            pages[-1] = header["pool_pages"] + data.draw(st.integers(0, 5))
        elif edit == "pages-dup":
            pages[1] = pages[0]
        else:  # pages-held
            pages[0] = data.draw(st.sampled_from(sorted(held_before(objs)[i])))
        m[i]["pages"] = pages
        want = "SLAB-1"
    else:  # shrink-span
        a, b = objs[i]["tokens"]
        m[i]["tokens"] = [a, b - 1]
        lay = objs[i]["layers"]
        m[i]["bytes"] = objs[i]["bytes"] // (b - a) * (b - 1 - a)
        admit = later(objs, i, lambda x: x["kind"] == "admit")
        result = verdict(m)
        if admit is None:
            assert result.ok or result.code == "COPY-1", result.text()
        else:
            assert (result.code, result.line) == ("COV-3", admit + 1), (result.text(), lay)
        return
    result = verdict(m)
    assert (result.code, result.line) == (want, i + 1), (edit, result.text())


@SETTINGS
@given(legal_traces(), st.data())
def test_any_field_any_value_never_crashes(trace, data):
    """Any field of any line replaced by any JSON value: a verdict, never a traceback."""
    objs = to_objs(*trace)
    i = data.draw(st.integers(0, len(objs) - 1))
    key = data.draw(st.sampled_from(sorted(objs[i]) + ["extra"]))
    value = data.draw(st.recursive(
        st.none() | st.booleans() | st.integers(-2**64, 2**64) | st.floats(allow_nan=False)
        | st.text(max_size=5), lambda c: st.lists(c, max_size=3)
        | st.dictionaries(st.text(max_size=3), c, max_size=3), max_leaves=6))
    objs[i] = {**objs[i], key: value}
    result = check_lines([(json.dumps(o) + "\n").encode() for o in objs])
    assert_sane(result, len(objs))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=4))
def test_arbitrary_bytes_never_crash(garbage):
    """Arbitrary bytes after a good header: a verdict, and TRACE-1 for any non-event line."""
    header = ev.Header("t", "chunk", Geometry(2, 1, 2, 2, PT), 8, 2)
    lines = [(dumps(ev.header_to_json(header)) + "\n").encode(), *garbage]
    result = check_lines(lines)
    assert_sane(result, len(lines))
    if garbage:
        assert not result.ok


# --- strict parsing: every malformed line is TRACE-1 with its line number --------------------

HEADER = ('{"kind":"header","version":1,"source":"t","mode":"chunk","geometry":{"layers":2,'
          '"kv_heads":1,"head_dim":2,"dtype_bytes":2,"page_tokens":4},"pool_pages":8,'
          '"max_pending":2}')
RESERVE = '{"kind":"reserve","t":0,"req":"r","prompt":8,"prefix":0,"pages":[0,1]}'

BAD_EVENT_LINES = {
    "float token count": '{"kind":"computed","t":1,"req":"r","layers":[0,2],"tokens":[0,8.0]}',
    "float prompt": '{"kind":"reserve","t":1,"req":"q","prompt":8.0,"prefix":0,"pages":[2,3]}',
    "bool token": '{"kind":"computed","t":1,"req":"r","layers":[0,2],"tokens":[0,true]}',
    "bool prompt": '{"kind":"reserve","t":1,"req":"q","prompt":true,"prefix":0,"pages":[2]}',
    "bool page": '{"kind":"reserve","t":1,"req":"q","prompt":4,"prefix":0,"pages":[true]}',
    "bool bytes": '{"kind":"issue","t":1,"req":"r","span":1,"layers":[0,1],"tokens":[0,0],'
                  '"bytes":false}',
    "bool t": '{"kind":"admit","t":true,"req":"r"}',
    "bool span": '{"kind":"land","t":1,"req":"r","span":true}',
    "float span": '{"kind":"land","t":1,"req":"r","span":1.5}',
    "empty span": '{"kind":"land","t":1,"req":"r","span":""}',
    "negative span": '{"kind":"land","t":1,"req":"r","span":-1}',
    "string t": '{"kind":"admit","t":"1","req":"r"}',
    "negative t": '{"kind":"admit","t":-1,"req":"r"}',
    "number req": '{"kind":"admit","t":1,"req":5}',
    "empty req": '{"kind":"admit","t":1,"req":""}',
    "missing req": '{"kind":"admit","t":1}',
    "missing t": '{"kind":"admit","req":"r"}',
    "missing bytes": '{"kind":"issue","t":1,"req":"r","span":1,"layers":[0,1],"tokens":[0,1]}',
    "missing pages": '{"kind":"reserve","t":1,"req":"q","prompt":4,"prefix":0}',
    "string range": '{"kind":"reuse","t":1,"req":"r","tokens":"0,4"}',
    "short range": '{"kind":"reuse","t":1,"req":"r","tokens":[0]}',
    "long range": '{"kind":"reuse","t":1,"req":"r","tokens":[0,1,2]}',
    "range a > b": '{"kind":"reuse","t":1,"req":"r","tokens":[4,2]}',
    "range a = b + 1": '{"kind":"computed","t":1,"req":"r","layers":[1,0],"tokens":[0,8]}',
    "negative range": '{"kind":"reuse","t":1,"req":"r","tokens":[-1,2]}',
    "pages not a list": '{"kind":"reserve","t":1,"req":"q","prompt":4,"prefix":0,"pages":3}',
    "error not a string": '{"kind":"fail","t":1,"req":"r","span":1,"error":5}',
    "reason null": '{"kind":"abort","t":1,"req":"r","reason":null}',
    "stage name empty": '{"kind":"stage","t":1,"req":"r","name":"","end":2}',
    "stage end string": '{"kind":"stage","t":1,"req":"r","name":"x","end":"2"}',
    "NaN": '{"kind":"admit","t":NaN,"req":"r"}',
    "Infinity": '{"kind":"admit","t":Infinity,"req":"r"}',
    "-Infinity": '{"kind":"admit","t":-Infinity,"req":"r"}',
    "1e400": '{"kind":"admit","t":1e400,"req":"r"}',
    "1e400 token": '{"kind":"reuse","t":1,"req":"r","tokens":[0,1e400]}',
    "t 2**53": '{"kind":"admit","t":9007199254740992,"req":"r"}',
    "int 2**53": '{"kind":"produced","t":1,"req":"r","token":9007199254740992}',
    "int 2**64": '{"kind":"produced","t":1,"req":"r","token":18446744073709551616}',
    "int 10**400": '{"kind":"produced","t":1,"req":"r","token":1' + "0" * 400 + "}",
    "unknown kind": '{"kind":"teleport","t":1,"req":"r"}',
    "kind not a string": '{"kind":["admit"],"t":1,"req":"r"}',
    "no kind": '{"t":1,"req":"r"}',
    "second header": HEADER,
    "a list": "[1,2]",
    "a string": '"admit"',
    "a number": "5",
    "null": "null",
    "true": "true",
    "not JSON": "{kind: admit}",
    "truncated": '{"kind":"admit","t":1,',
    "trailing garbage": '{"kind":"admit","t":1,"req":"r"} x',
    "empty line": "",
    "blank line": "   ",
    "deep nesting": "[" * 5000 + "]" * 5000,
    "BOM": '\ufeff{"kind":"admit","t":1,"req":"r"}',
    "lone surrogate": '{"kind":"admit","t":1,"req":"\\ud800"}',
}


@pytest.mark.parametrize("line", list(BAD_EVENT_LINES.values()), ids=list(BAD_EVENT_LINES))
def test_malformed_event_line_is_trace1(line):
    """A malformed third line is TRACE-1 at line 3, after a good header and reserve."""
    lines = [HEADER.encode() + b"\n", RESERVE.encode() + b"\n", line.encode() + b"\n",
             b'{"kind":"abort","t":9,"req":"r","reason":"x"}\n']
    result = check_lines(lines)
    assert (result.code, result.line) == ("TRACE-1", 3), result.text()


def test_invalid_utf8_is_trace1():
    """Bytes that are not UTF-8, alone or inside a string, are TRACE-1 with the line."""
    for bad in (b"\xff\xfe\n", b'{"kind":"admit","t":1,"req":"\xff"}\n', b"\xc3\n"):
        result = check_lines([HEADER.encode() + b"\n", RESERVE.encode() + b"\n", bad])
        assert (result.code, result.line) == ("TRACE-1", 3)


def header_with(**changes) -> str:
    obj = json.loads(HEADER)
    for key, value in changes.items():
        if key.startswith("geo_"):
            obj["geometry"][key[4:]] = value
        elif value is ...:
            del obj[key]
        else:
            obj[key] = value
    return json.dumps(obj)


BAD_HEADERS = {
    "missing header": RESERVE,
    "version 5": header_with(version=5),
    "version 0": header_with(version=0),
    "version string": header_with(version="1"),
    "version float": header_with(version=1.0),
    "version bool": header_with(version=True),
    "no version": header_with(version=...),
    "bad mode": header_with(mode="fast"),
    "no mode": header_with(mode=...),
    "no geometry": header_with(geometry=...),
    "geometry a list": header_with(geometry=[2, 1]),
    "zero layers": header_with(geo_layers=0),
    "float layers": header_with(geo_layers=2.0),
    "zero page_tokens": header_with(geo_page_tokens=0),
    "recurrent string": header_with(geo_recurrent="yes"),
    "negative pool": header_with(pool_pages=-1),
    "no pool": header_with(pool_pages=...),
    "zero max_pending": header_with(max_pending=0),
    "bool max_pending": header_with(max_pending=True),
    "source not a string": header_with(source=3),
    "header a list": "[]",
    "not JSON": "header",
}


@pytest.mark.parametrize("line", list(BAD_HEADERS.values()), ids=list(BAD_HEADERS))
def test_malformed_header_is_trace1(line):
    """A bad or missing header is TRACE-1 at line 1."""
    result = check_lines([line.encode() + b"\n", RESERVE.encode() + b"\n"])
    assert (result.code, result.line) == ("TRACE-1", 1), result.text()


def test_empty_trace_is_trace1(tmp_path):
    """An empty file (or no lines at all) is TRACE-1 at line 1."""
    assert (check_lines([]).code, check_lines([]).line) == ("TRACE-1", 1)
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    result = check_file(path)
    assert (result.ok, result.code, result.line) == (False, "TRACE-1", 1)


def test_trace2_time_and_stage_end():
    """t going back and a stage ending before it starts are TRACE-2 with the line."""
    back = b'{"kind":"computed","t":0.5,"req":"r","layers":[0,2],"tokens":[0,8]}\n'
    lines = [HEADER.encode() + b"\n", RESERVE.replace('"t":0', '"t":1').encode() + b"\n", back]
    assert (check_lines(lines).code, check_lines(lines).line) == ("TRACE-2", 3)
    stage = b'{"kind":"stage","t":2,"req":"r","name":"x","end":1.5}\n'
    lines = [HEADER.encode() + b"\n", RESERVE.encode() + b"\n", stage]
    assert (check_lines(lines).code, check_lines(lines).line) == ("TRACE-2", 3)
    same = b'{"kind":"stage","t":0,"req":"r","name":"x","end":0}\n'
    lines = [HEADER.encode() + b"\n", RESERVE.encode() + b"\n", same]
    assert check_lines(lines, open_trace=True).ok


def test_extra_fields_are_allowed():
    """Unknown extra fields on the header and events are extensions, not errors."""
    header = header_with(chunk=64, hw="x")
    line = '{"kind":"abort","t":1,"req":"r","reason":"x","why":{"a":[1]}}'
    result = check_lines([header.encode(), RESERVE.encode(), line.encode()])
    assert result.ok and result.events == 2


def test_cfg1_from_a_header():
    """A layer-mode header for a recurrent geometry is CFG-1 at line 1."""
    line = header_with(mode="layer", geo_recurrent=True)
    result = check_lines([line.encode() + b"\n"])
    assert (result.code, result.line) == ("CFG-1", 1)


def test_life1_at_end_and_open():
    """Ending while holding pages is LIFE-1 at the last line, unless the trace is open."""
    lines = [HEADER.encode() + b"\n", RESERVE.encode() + b"\n"]
    result = check_lines(lines)
    assert (result.code, result.line) == ("LIFE-1", 2)
    assert check_lines(lines, open_trace=True).ok
