"""pdgpu/serve/bugs.py: `--debug` bugs are objects given to a producer at construction; a
producer without one never looks at `config.debug`, and each bug does what it says through
its hooks (the served runs that must catch each one are in test_pdgpu_serve.py)."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest
import torch

from pdgpu.model import build_model
from pdgpu.serve import producer as producer_module
from pdgpu.serve.bugs import BUGS, NO_BUG, DropLastRow, EarlyReuse, IssueEarly, bug_for
from pdgpu.serve.config import DEBUG_BUGS, ServeConfig
from pdgpu.serve.producer import Producer
from pdgpu.serve.transport import Message
from pdref.models import load_model
from pdref.plan import plan_spans

PROMPT, CHUNK, PAGE = 40, 16, 16


class Recording:
    """A transport to nowhere: keeps every message the producer sends, in order."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.changed = threading.Condition()

    def send(self, dst, op, body, tensors=()) -> None:
        with self.changed:
            self.sent.append(Message(dst, op, body, tuple(tensors)))
            self.changed.notify_all()

    def get(self, timeout):
        return None

    def staging(self, dst, specs, device):
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]

    def ops(self) -> list[str]:
        return [m.op for m in self.sent if m.op != "beat"]

    def spans(self, count: int) -> list[Message]:
        """The first `count` span messages, waiting (bounded) for the sender thread."""
        def done():
            return sum(m.op == "span" for m in self.sent) >= count
        with self.changed:
            assert self.changed.wait_for(done, timeout=30), self.ops()
        return [m for m in self.sent if m.op == "span"][:count]


class Poison:
    """A `debug` value that fails any test which compares, hashes or tests it."""

    def _refuse(self, *_):
        raise AssertionError("the producer consulted config.debug")

    __eq__ = __ne__ = __hash__ = __bool__ = __str__ = _refuse


@pytest.fixture(scope="module")
def model():
    return build_model(load_model("tiny"), seed=0)


def _producer(model, mode: str, bugs=NO_BUG, debug=None) -> tuple[Producer, Recording]:
    pages = 2 * -(-PROMPT // PAGE)
    config = ServeConfig("tiny", mode, chunk=CHUNK, max_pending=64, page_tokens=PAGE,
                         source_pages=pages, debug=debug)
    transport = Recording()
    return Producer(transport, config, model, "p1", bugs), transport


def _serve_one(producer: Producer, transport: Recording) -> list[Message]:
    """One request computed and produced on this thread; its span messages."""
    producer._handle(Message(0, "prefill", {"handle": "r0.0", "tokens": list(range(1, 41))}))
    producer._step()
    while producer.active is not None:
        producer._step()
    producer._step()  # idle: a copy still held back starts here
    mode = producer.config.mode
    return transport.spans(len(plan_spans(mode, producer.geometry, PROMPT, 0, CHUNK)))


def _run(model, mode: str, bugs=NO_BUG, debug=None) -> tuple[list[Message], Recording]:
    producer, transport = _producer(model, mode, bugs, debug)
    try:
        return _serve_one(producer, transport), transport
    finally:
        producer.close()


def test_every_debug_option_has_its_bug():
    """Each `--debug` name makes a fresh object of its own class; none makes NO_BUG."""
    assert BUGS.keys() == DEBUG_BUGS.keys()
    assert bug_for(None) is NO_BUG
    for name, cls in BUGS.items():
        assert type(bug_for(name)) is cls
    assert bug_for("early-reuse") is not bug_for("early-reuse")  # its held spans are its own
    with pytest.raises(ValueError, match="unknown bug 'nope'"):
        bug_for("nope")


def test_the_producer_source_reads_no_debug_switch():
    """No `.debug` attribute is read anywhere in pdgpu/serve/producer.py."""
    tree = ast.parse(Path(producer_module.__file__).read_text())
    reads = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "debug"]
    assert reads == []


@pytest.mark.parametrize("mode", ["whole", "chunk", "layer"])
def test_a_producer_without_a_bug_never_consults_debug(model, mode):
    """`config.debug` that fails when looked at: the producer serves a request, each span
    issued after its step was computed, no row dropped, no source page freed."""
    producer, transport = _producer(model, mode, debug=Poison())
    try:
        free = producer.cache.pool.free_pages
        spans = _serve_one(producer, transport)
        assert producer.cache.pool.free_pages == free - -(-PROMPT // PAGE)  # until `reuse`
    finally:
        producer.close()
    ops = transport.ops()
    assert ops.index("computed") < ops.index("issue")
    assert all(m.tensors[0][:, :, -1].abs().sum() > 0 for m in spans)


@pytest.mark.parametrize("mode", ["chunk", "layer"])
def test_issue_early_announces_a_span_before_computing_it(model, mode):
    """IssueEarly: every streamed step's `issue` comes before its `computed`."""
    _, transport = _run(model, mode, IssueEarly())
    computed = [i for i, m in enumerate(transport.sent) if m.op == "computed"]
    assert len(computed) == 3 if mode == "chunk" else load_model("tiny").layers
    for i in computed:
        region = _region(transport.sent[i])
        assert region in [_region(m) for m in transport.sent[:i] if m.op == "issue"]


def _region(message: Message) -> tuple:
    return tuple(message.body["layers"]), tuple(message.body["tokens"])


def test_issue_early_leaves_whole_mode_alone(model):
    """Whole mode streams nothing during prefill: IssueEarly sends nothing early there."""
    _, transport = _run(model, "whole", IssueEarly())
    ops = transport.ops()
    assert ops.index("produced") < ops.index("issue")


def test_drop_last_row_zeroes_each_spans_last_token_row(model):
    """DropLastRow: the last token row of every span sent is zero, the row before is not."""
    spans, _ = _run(model, "chunk", DropLastRow())
    for m in spans:
        kv = m.tensors[0]  # [nl, 2, nt, KVH, D]
        assert torch.count_nonzero(kv[:, :, -1]) == 0 and torch.count_nonzero(kv[:, :, -2])


@pytest.mark.parametrize("mode", ["whole", "chunk", "layer"])
def test_early_reuse_gives_pages_back_at_produced_announced_as_reuse(model, mode):
    """EarlyReuse: at `produced` the life's pages are back in the pool, and a `reuse` of its
    tokens went to the decoder before the issue of its last span (every span in whole
    mode), which starts only at a later step: the decoder's ledger sees the give-back."""
    bug = EarlyReuse()
    producer, transport = _producer(model, mode, bug)
    try:
        free = producer.cache.pool.free_pages
        producer._handle(Message(0, "prefill", {"handle": "r0.0", "tokens": list(range(1, 41))}))
        while producer.active is not None or producer.waiting:
            producer._step()
        assert producer.cache.pool.free_pages == free and (bug.held or bug.late)  # one waits
        ops = transport.ops()
        assert ops.index("produced") < ops.index("reuse")
        reuse = next(m for m in transport.sent if m.op == "reuse")
        assert reuse.body == {"handle": "r0.0", "tokens": [0, PROMPT]}
        producer._step()
        producer._step()  # idle: the late spans start
        want = len(plan_spans(producer.config.mode, producer.geometry, PROMPT, 0, CHUNK))
        assert bug.held == bug.late == [] and len(transport.spans(want)) == want
        ops = transport.ops()
        assert len(ops) - 1 - ops[::-1].index("issue") > ops.index("reuse")  # the last issue
    finally:
        producer.close()
