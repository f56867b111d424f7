"""NcclTransport's own logic on CPU, a gloo group standing in for the NCCL one (the three
methods that touch CUDA replaced): the tensor lane is made and tried at connect, the higher
rank's tensors take it while control and the other direction stay on gloo, and a receive
waiting on a peer that never sends is abandoned when the link is dropped or times out."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from serve_helpers import close_ends, linked_pair

from pdgpu.serve.rendezvous import NCCL, TransportError
from pdgpu.serve.transport import hang_up
from pdgpu.serve.transport_nccl import NcclTransport

HELD_S = 120.0  # a held send's bound (the teardown releases it long before)


class Polled:
    """A gloo operation that can be polled like an NCCL one (gloo's own cannot)."""

    def __init__(self, work) -> None:
        self.error: Exception | None = None
        self.done = threading.Event()
        threading.Thread(target=self._wait, args=(work,), daemon=True).start()

    def _wait(self, work) -> None:
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - raised again by wait()
            self.error = e
        self.done.set()

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self) -> None:
        if self.error is not None:
            raise self.error


class PolledGroup:
    def __init__(self, pg, me: int) -> None:
        self.pg, self.other = pg, 1 - me

    def send(self, tensors, dst: int, tag: int) -> Polled:
        return Polled(self.pg.send(tensors, dst, tag))

    def recv(self, tensors, src: int, tag: int) -> Polled:
        return Polled(self.pg.recv(tensors, src, tag))

    def abort(self) -> None:
        """As NCCL's abort: every pending operation ends (gloo's abort() reaches none)."""
        hang_up(self.pg, self.other)


class GlooStandIn(NcclTransport):
    """NcclTransport with a gloo group for its tensor lane and the CPU as its 'device'."""

    def __init__(self, store, rank: int, gpu: str, timeout_s: float = 20.0) -> None:
        self.gpu = gpu
        super().__init__(store, rank, "cpu", timeout_s)
        self.data_sends: list[tuple[int, ...]] = []  # shapes sent over the tensor lane
        self.hold = threading.Event()  # set: the next tensor-lane send waits for `released`
        self.released = threading.Event()  # set: the held send gives up (its bytes never go)

    def _check_backend(self) -> None:
        pass

    def _on_device(self) -> None:
        pass

    def _identity(self) -> dict:
        return {"device": "cuda:0", "gpu": self.gpu}

    def _data_group(self, store, me: int, name: str):
        return PolledGroup(dist.ProcessGroupGloo(dist.PrefixStore("nccl", store), me, 2,
                                                 timedelta(seconds=self.timeout_s)), me)

    @staticmethod
    def _in_device_memory(tensor: torch.Tensor) -> bool:
        return True

    def _send_payload(self, link, tensor, via) -> None:
        if via == NCCL:
            if self.hold.is_set():  # a producer that died between header and bytes
                self.released.wait(HELD_S)  # (the test's teardown ends its sending thread)
                raise RuntimeError("held: the bytes never went")
            self.data_sends.append(tuple(tensor.shape))
        super()._send_payload(link, tensor, via)


@contextmanager
def _pair(timeout_s: float = 20.0):
    """A decoder (rank 0) and a producer (rank 1) on 'two GPUs', linked in this process;
    both closed on the way out, a held send released first."""
    decoder, producer = linked_pair(
        lambda store, rank: GlooStandIn(store, 0, "A", timeout_s) if rank == 0
        else GlooStandIn(store, 1, "B"), join_s=20)
    try:
        yield decoder, producer
    finally:
        producer.released.set()
        close_ends((decoder, producer))


def test_kv_takes_the_tensor_lane_one_way_only():
    """The producer's tensors go over the tensor group (tried once at connect), arrive
    equal on the decoder; the decoder's tensors to the producer stay on gloo."""
    with _pair() as (decoder, producer):
        assert decoder.lanes() == {1: NCCL} and producer.lanes() == {0: NCCL}
        assert decoder.links[1].data is not None and producer.links[0].data is not None
        kv, digests = torch.randn(2, 2, 5, 3, 4), torch.arange(20).view(2, 2, 5)
        producer.send(0, "span", {"sid": 1}, (kv, digests, torch.empty(0, 3)))
        msg = decoder.get(timeout=20)
        assert torch.equal(msg.tensors[0], kv) and torch.equal(msg.tensors[1], digests)
        assert producer.data_sends == [(2, 2, 5, 3, 4), (2, 2, 5)]  # the empty one: not sent
        decoder.send(1, "probe", {}, (torch.ones(3),))
        back = producer.get(timeout=20)
        assert back.op == "probe" and torch.equal(back.tensors[0], torch.ones(3))
        assert decoder.data_sends == []  # the decoder -> producer direction stays on gloo


def test_a_receive_from_a_dead_peer_ends_when_the_link_is_dropped():
    """The producer announces a span and never sends its bytes: the decoder's receiving
    thread waits on the tensor lane until the decoder drops the link, then ends (nothing
    from the dropped link reaches the decoder)."""
    with _pair() as (decoder, producer):
        link = decoder.links[1]
        producer.hold.set()
        producer.send(0, "span", {"sid": 1}, (torch.randn(2, 3),))
        time.sleep(1.0)
        assert link.thread.is_alive() and decoder.get(timeout=0) is None  # waiting for bytes
        decoder.drop(1)
        link.thread.join(timeout=5)
        assert not link.thread.is_alive() and link.aborted.is_set()
        assert decoder.get(timeout=0.2) is None


def test_a_receive_never_outlasts_the_timeout():
    """Without a drop, a tensor that does not come within the connect timeout breaks the
    link: the decoder hears `lost` naming the timeout, and the group is aborted."""
    timeout_s = 1.5
    with _pair(timeout_s) as (decoder, producer):
        producer.hold.set()
        producer.send(0, "span", {"sid": 1}, (torch.randn(2, 3),))
        msg = decoder.get(timeout=timeout_s + 10)
        assert msg.op == "lost" and f"not done within {timeout_s:g} s" in msg.body["error"]
        assert decoder.links[1].aborted.is_set()


@pytest.mark.skipif(dist.is_nccl_available(), reason="checks a torch built without NCCL")
def test_a_torch_without_nccl_is_named():
    """A CUDA transport on a torch without NCCL fails at once, saying so in one line."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=5),
                          wait_for_workers=False)
    with pytest.raises(TransportError, match="is_nccl_available"):
        NcclTransport(store, 0, "cuda:0")
