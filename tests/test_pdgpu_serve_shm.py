"""The shared-memory KV lane (pdgpu/serve/transport_shm.py): both ends agree on it at connect,
a slot is never reused before the reader consumed it, segments are unlinked however a link
ends, the page-locked variant pins and unpins every mapping (CPU stand-ins for CUDA's calls),
and on a GPU `pdgpu serve` on one device takes it (scripts/gpu_check.sh)."""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest
import torch
from serve_helpers import (
    close_ends,
    drawn_prompts,
    linked_pair,
    reference,
    serve,
    shm_segments,
)

from pdgpu.serve import transport_shm
from pdgpu.serve.rendezvous import GLOO, NCCL, SHM, SHM_PINNED, STAGED, choose_lane
from pdgpu.serve.transport import GlooTransport
from pdgpu.serve.transport_shm import MAX_SLOTS, OUT, SHM_DIR, WriterRing


def _desc(device="cpu", gpu=None, host="h", shm="pdgpu-kv-1-a") -> dict:
    return {"device": device, "gpu": gpu, "host": host, "shm": shm}


@pytest.mark.parametrize(("a", "b", "lane"), [
    (_desc(), _desc(shm="pdgpu-kv-2-b"), SHM),
    (_desc(), _desc(host="other"), GLOO),  # another machine: no /dev/shm in common
    (_desc(), _desc(shm=None), GLOO),  # --kv-lane gloo at one end
    ({"device": "cpu", "gpu": None}, _desc(), GLOO),  # a peer that offers nothing
    (_desc("cuda:0", "A"), _desc("cuda:0", "A"), SHM_PINNED),
    (_desc("cuda:0", "A"), _desc("cuda:0", "A", shm=None), STAGED),
    (_desc("cuda:0", "A"), _desc("cuda:1", "B"), NCCL),  # two GPUs: NCCL stays
])
def test_the_lane_is_shared_memory_only_on_one_machine_when_both_offer_it(a, b, lane):
    """choose_lane is symmetric and takes shared memory only where both ends can map it."""
    assert choose_lane(a, b) == choose_lane(b, a) == lane


class _Pinned(GlooTransport):
    """A CPU transport that says it runs on GPU "A": the shm-pinned lane without CUDA."""

    def descriptor(self) -> dict:
        return {"device": "cuda:0", "gpu": "A"}


def _pair(cls=GlooTransport, shm=(True, True)):
    """Two transports of this process joined by one link (rank 1 writes, rank 0 reads)."""
    return linked_pair(lambda store, rank: cls(store, rank, 20, shm[rank]), join_s=20)


def test_a_slot_is_not_reused_before_the_reader_consumed_it():
    """MAX_SLOTS messages out and unconsumed: the next send waits, every unconsumed message's
    bytes stay as sent; once the reader is done with one, the waiting message takes its slot."""
    reader, writer = _pair()
    try:
        assert reader.lanes() == {1: SHM} and writer.lanes() == {0: SHM}
        for i in range(MAX_SLOTS):
            writer.send(0, "span", {"i": i}, (torch.full((1000,), float(i)),))
        held = [reader.get(timeout=20) for _ in range(MAX_SLOTS)]
        assert sorted(m.slots[0] for m in held) == list(range(MAX_SLOTS))
        assert writer.links[0].ring.take(8) is None  # every slot is the reader's
        late = threading.Thread(target=writer.send, args=(0, "span", {"i": 99},
                                                          (torch.full((1000,), 99.0),)))
        late.start()
        assert reader.get(timeout=0.3) is None and late.is_alive()
        assert all(torch.equal(m.tensors[0], torch.full((1000,), float(i)))
                   for i, m in enumerate(held))
        reader.done(held[3])
        msg = reader.get(timeout=20)
        late.join(timeout=20)
        assert msg.body == {"i": 99} and msg.slots == held[3].slots
        assert torch.equal(msg.tensors[0], torch.full((1000,), 99.0))
        assert all(torch.equal(m.tensors[0], torch.full((1000,), float(i)))
                   for i, m in enumerate(held) if i != 3)
    finally:
        close_ends([reader, writer])


def test_tensors_of_every_size_and_dtype_cross_and_a_slot_grows():
    """kv and int64 digests in one slot, an empty tensor beside them, then a message larger
    than the slot (a new, larger file for it): all arrive equal; --kv-lane gloo at one end
    gives gloo."""
    reader, writer = _pair()
    try:
        kv = torch.randn(2, 2, 3, 4).to(torch.bfloat16)  # [nl, 2, nt, D]
        digests = torch.randint(-2**62, 2**62, (2, 2, 3), dtype=torch.int64)
        writer.send(0, "span", {"sid": 7}, (kv, digests, torch.empty(0, 4)))
        msg = reader.get(timeout=20)
        assert torch.equal(msg.tensors[0], kv) and torch.equal(msg.tensors[1], digests)
        assert msg.tensors[2].shape == (0, 4)
        reader.done(msg)
        big = torch.arange(3 * 2**20 // 4, dtype=torch.float32)  # 3 MB: larger than a slot
        writer.send(0, "span", {"sid": 8}, (big,))
        msg = reader.get(timeout=20)
        assert torch.equal(msg.tensors[0], big) and msg.slots == (0,)
        reader.done(msg)
    finally:
        close_ends([reader, writer])
    gloo = _pair(shm=(True, False))
    assert gloo[0].lanes() == {1: GLOO}
    close_ends(gloo)


def test_segments_are_unlinked_however_the_link_ends():
    """The reader unlinks a slot's file once mapped; files it never saw (a writer killed
    right after making them) go when the reader drops the link, and at close."""
    reader, writer = _pair()
    try:
        writer.send(0, "span", {}, (torch.ones(10),))
        reader.done(reader.get(timeout=20))
        assert shm_segments() == []  # mapped by both, unlinked by the reader
        ring = writer.links[0].ring
        assert ring.take(10).index == 0 and shm_segments() == []  # the mapped one, again
        ring.take(10)  # as if the writer made a file and was killed before naming it
        assert len(shm_segments()) == 1
        reader.drop(1)
        assert shm_segments() == []
        ring.take(10)
        assert len(shm_segments()) == 1
    finally:
        close_ends([reader, writer])
    assert shm_segments() == []


def test_the_pinned_lane_pins_and_unpins_every_mapping(monkeypatch):
    """shm-pinned (one GPU): each end page-locks each slot mapping it makes and unlocks it
    when the slot or the link goes (CUDA's calls recorded instead of made)."""
    pinned: dict[int, int] = {}

    def pin(memory):
        pinned[memory.data_ptr()] = pinned.get(memory.data_ptr(), 0) + 1

    def unpin(memory):
        pinned[memory.data_ptr()] -= 1

    monkeypatch.setattr(transport_shm, "pin_host", pin)
    monkeypatch.setattr(transport_shm, "unpin_host", unpin)
    reader, writer = _pair(_Pinned)
    try:
        assert reader.lanes() == {1: SHM_PINNED}
        writer.send(0, "span", {}, (torch.ones(10),))
        msg = reader.get(timeout=20)
        assert torch.equal(msg.tensors[0], torch.ones(10))
        reader.done(msg)
        assert len(pinned) == 2 and all(n == 1 for n in pinned.values())  # both ends' maps
    finally:
        close_ends([reader, writer])
    assert all(n == 0 for n in pinned.values())


def test_a_ring_waits_for_a_slot_and_names_the_broken_link():
    """With every slot OUT, acquire waits; a broken link ends the wait with its reason."""
    ring = WriterRing(f"pdgpu-kv-{os.getpid()}-ring", pinned=False)
    try:
        slots = [ring.take(64) for _ in range(MAX_SLOTS)]
        assert all(int(s.state[0]) == OUT for s in slots) and ring.take(64) is None
        with pytest.raises(transport_shm.SlotError, match="the decoder is gone"):
            ring.acquire(64, lambda: "the decoder is gone")
        slots[5].state[0] = transport_shm.FREE  # what the reader's release writes
        assert ring.acquire(64, lambda: None).index == 5
    finally:
        ring.close()
    assert not list(SHM_DIR.glob(f"pdgpu-kv-{os.getpid()}-ring-*"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_gpu_serves_through_pinned_shared_memory(tmp_path, capsys):
    """Decoder and producers on cuda:0: KV crosses through page-locked shared memory (lane
    shm-pinned), and every request's tokens equal generate on cuda:0."""
    prompts = drawn_prompts(tmp_path / "p.jsonl", 4, [40, 57, 33, 64], 256, 0, 4)
    code, results, trace = serve(
        tmp_path, "--model", "tiny", "--producers", "2", "--prompts", str(tmp_path / "p.jsonl"),
        "--chunk", "16", "--device", "cuda:0", "--decoder-device", "cuda:0", "--json")
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and summary["transport"] == SHM_PINNED
    assert all(r["status"] == "ok" for r in results)
    header = json.loads(trace[0])
    assert header["transport"] == SHM_PINNED and header["verify"] is True
    for line, r in zip(prompts, results, strict=True):
        assert r["output"] == reference("tiny", line["tokens"], 4, 16, 0, device="cuda:0")


def test_a_full_dev_shm_sends_the_message_over_gloo_and_says_so(monkeypatch, capsys):
    """/dev/shm without room for a slot (its pages cannot be allocated): that message crosses
    over gloo, equal, and no half-made file is left; the writer says so once, and the
    reader's bytes by lane name gloo, not shm."""
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    reader, writer = _pair()
    try:
        writer.send(0, "span", {"sid": 0}, (torch.arange(4.0),))
        reader.done(reader.get(timeout=20))
        monkeypatch.setattr(transport_shm.os, "posix_fallocate", full)
        for sid in (1, 2):
            writer.send(0, "span", {"sid": sid}, (torch.arange(1 << 19, dtype=torch.int32),))
            msg = reader.get(timeout=20)
            assert torch.equal(msg.tensors[0], torch.arange(1 << 19, dtype=torch.int32))
            assert msg.slots == ()
        assert shm_segments() == []
        assert reader.received_bytes() == {GLOO: 2 << 21, SHM: 16}
        assert capsys.readouterr().err.count("such messages go over gloo") == 1
    finally:
        close_ends([reader, writer])


def test_a_dev_shm_too_small_for_the_slots_is_refused_at_connect(monkeypatch, capsys):
    """/dev/shm with less room than a link's slots at their smallest: the reader offers no
    shared memory, says why, and both ends agree on gloo."""
    monkeypatch.setattr(transport_shm, "free_bytes", lambda: 4 << 20)
    reader, writer = _pair()
    try:
        assert reader.lanes() == {1: GLOO} and writer.lanes() == {0: GLOO}
        assert "kv lane shm refused" in capsys.readouterr().err
    finally:
        close_ends([reader, writer])


def test_a_staged_slot_is_sent_without_a_copy_or_freed_when_not_sent():
    """staging: the writer fills views of a slot and sends them as they are (the same slot,
    nothing copied in); staged buffers it does not send go back FREE; over gloo, staging
    gives plain tensors."""
    reader, writer = _pair()
    try:
        kv, sums = writer.staging(0, [((2, 3), torch.float32), ((4,), torch.int64)], "cpu")
        ring = writer.links[0].ring
        slot = ring.staged[0]
        assert kv.data_ptr() == in_slot_ptr(slot, 0)
        kv.copy_(torch.arange(6.0).view(2, 3))
        sums.copy_(torch.arange(4))
        writer.send(0, "span", {}, (kv, sums))
        msg = reader.get(timeout=20)
        assert msg.slots == (slot.index,) and torch.equal(msg.tensors[1], torch.arange(4))
        assert torch.equal(msg.tensors[0], torch.arange(6.0).view(2, 3))
        writer.staging(0, [((8,), torch.float32)], "cpu")
        unsent = ring.staged[0]
        writer.send(0, "beat")  # a control message (another thread's) leaves staging alone
        assert ring.staged[0] is unsent
        writer.send(0, "span", {}, (torch.ones(3),))  # other tensors: the staged slot is
        other = [m for m in (reader.get(timeout=20), reader.get(timeout=20)) if m.op == "span"]
        assert other[0].slots == (unsent.index,) and ring.staged is None  # FREE, then reused
        assert torch.equal(other[0].tensors[0], torch.ones(3))
    finally:
        close_ends([reader, writer])
    gloo = _pair(shm=(True, False))
    try:
        (plain,) = gloo[1].staging(0, [((8,), torch.float32)], "cpu")
        assert plain.shape == (8,) and gloo[1].links[0].ring is None
    finally:
        close_ends(gloo)


def in_slot_ptr(slot, index: int) -> int:
    """Where a slot's `index`-th staged tensor starts: after the state word."""
    return slot.memory.data_ptr() + transport_shm.ALIGN * (index + 1)
