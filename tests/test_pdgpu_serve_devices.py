"""pdgpu serve devices and transports on CPU: the backend follows the device, both ends of a
link agree on its lane, CUDA and mixed devices are refused in one line where they cannot
run, and a served CPU run names its transport."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from serve_helpers import close_ends, linked_pair, producers_alive, serve

from pdgpu.cli import main
from pdgpu.serve.config import Capabilities, producer_capabilities, refusal
from pdgpu.serve.devices import serve_devices
from pdgpu.serve.rendezvous import GLOO, NCCL, STAGED, choose_lane
from pdgpu.serve.transport import GlooTransport
from pdgpu.serve.transport_nccl import backend_for, open_transport
from pdgpu.workload import WorkloadError
from pdref.events import Mode

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")


def _one_line_exit_2(capsys, argv) -> str:
    before = producers_alive()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("pdgpu: error:"), err
    assert producers_alive() <= before
    return err


def test_backend_follows_the_device():
    """cpu gets gloo, any CUDA device NCCL; a CPU process's transport is GlooTransport."""
    assert backend_for("cpu") == "gloo"
    assert backend_for("cuda") == backend_for("cuda:1") == "nccl"
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=5),
                          wait_for_workers=False)
    assert type(open_transport(store, 0, "cpu")) is GlooTransport


def test_lane_rule_is_symmetric():
    """NCCL only between two distinct GPUs; one GPU or a CPU end stages through the host."""
    cpu = {"device": "cpu", "gpu": None}
    a0, b0 = {"device": "cuda:0", "gpu": "GPU-a"}, {"device": "cuda:0", "gpu": "GPU-b"}
    a1 = {"device": "cuda:1", "gpu": "GPU-a"}
    cases = [(cpu, cpu, GLOO), (a0, b0, NCCL), (a0, a1, STAGED), (cpu, a0, STAGED)]
    for mine, theirs, lane in cases:
        assert choose_lane(mine, theirs) == choose_lane(theirs, mine) == lane


@NO_CUDA
@pytest.mark.parametrize("argv", [
    ["serve", "--device", "cuda"],
    ["serve", "--device", "cuda:1", "--producers", "2"],
    ["serve", "--decoder-device", "cuda"],
    ["generate", "--tokens", "1,2,3", "--device", "cuda"],
])
def test_cuda_without_cuda_is_refused(capsys, argv):
    """--device cuda on a machine without CUDA: one line naming the field and the rule."""
    err = _one_line_exit_2(capsys, [*argv, "--no-progress"] if argv[0] == "serve" else argv)
    field = "decoder-device" if "--decoder-device" in argv else "device"
    assert f"{field}: " in err and "torch.cuda.is_available() is false" in err


@pytest.mark.parametrize("device", ["gpu", "cpu:1", "cuda:x", "CUDA", ""])
def test_device_spelling_is_refused(capsys, device):
    """Only cpu, cuda and cuda:N are devices."""
    err = _one_line_exit_2(capsys, ["serve", "--no-progress", "--device", device])
    assert "device: must be cpu, cuda or cuda:N" in err


def test_device_rules_with_cuda(monkeypatch):
    """With two GPUs: cuda means cuda:0, the decoder defaults to the producers' device,
    mixed kinds, a missing GPU and --decoder-device with --role are refused."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert serve_devices("cuda", None, None) == ("cuda:0", "cuda:0")
    assert serve_devices("cuda:0", "cuda:1", None) == ("cuda:0", "cuda:1")
    assert serve_devices("cpu", None, None) == ("cpu", "cpu")
    refused = [(("cpu", "cuda:1", None), "decoder-device: mixed devices are not served"),
               (("cuda", "cpu", None), "decoder-device: mixed devices are not served"),
               (("cuda:2", None, None), "device: cuda:2 is not a device here"),
               (("cuda", "cuda:1", "decoder"), "decoder-device: only for a local run")]
    for args, message in refused:
        with pytest.raises(WorkloadError, match=message):
            serve_devices(*args)


def test_handshake_refuses_a_producer_on_another_kind_of_device():
    """A remote producer on cpu under a CUDA decoder (or the reverse) is refused at the
    handshake; same kinds serve; capabilities without a device (older producers) are cpu."""
    gpu = producer_capabilities("p1", recurrent=False, kv_progress=True, device="cuda:0")
    cpu = producer_capabilities("p2", recurrent=False, kv_progress=True)
    assert refusal(Mode.CHUNK, [gpu], "cuda:1") is None
    assert refusal(Mode.CHUNK, [cpu], "cpu") is None
    assert "device: mixed devices are not served (producer p2 on cpu" in \
        refusal(Mode.CHUNK, [gpu, cpu], "cuda:0")
    assert "producer p1 on cuda:0, the decoder on cpu" in refusal(Mode.WHOLE, [gpu], "cpu")
    assert Capabilities.from_json(gpu.to_json()) == gpu
    old = {k: v for k, v in cpu.to_json().items() if k != "device"}
    assert Capabilities.from_json(old).device == "cpu"


class _ClaimsGpu(GlooTransport):
    """A CPU transport that says it runs on a GPU: the lane agreement without CUDA."""

    def __init__(self, store, rank, gpu) -> None:
        super().__init__(store, rank, timeout_s=20)
        self.gpu = gpu

    def descriptor(self) -> dict:
        return {"device": "cuda:0", "gpu": self.gpu}


@pytest.mark.parametrize(("gpus", "lane"), [(None, GLOO), (("A", "A"), STAGED),
                                            (("A", "B"), NCCL)])
def test_both_ends_agree_on_the_lane_and_messages_cross(gpus, lane):
    """Two transports in this process connect one link; each end reports the same lane and
    a message's tensors (float and int64, one empty) arrive equal."""
    ends = linked_pair(lambda store, rank: GlooTransport(store, rank, 20) if gpus is None
                       else _ClaimsGpu(store, rank, gpus[rank]), join_s=20)
    try:
        assert ends[0].lanes() == {1: lane} and ends[1].lanes() == {0: lane}
        kv = torch.randn(2, 2, 3, 4)  # [nl, 2, nt, D]
        digests = torch.randint(-2**62, 2**62, (2, 2, 3), dtype=torch.int64)
        ends[1].send(0, "span", {"sid": 7}, (kv, digests, torch.empty(0, 4)))
        msg = ends[0].get(timeout=20)
        assert (msg.op, msg.body) == ("span", {"sid": 7})
        assert torch.equal(msg.tensors[0], kv) and torch.equal(msg.tensors[1], digests)
        assert msg.tensors[2].shape == (0, 4)
    finally:
        close_ends(ends)


def test_a_served_cpu_run_names_its_transport(tmp_path, capsys):
    """--device cpu serves through shared memory by default: the summary and the trace
    header say so."""
    code, results, trace = serve(tmp_path, "--model", "tiny", "--requests", "2",
                                 "--prompt-range", "20:40", "--output-tokens", "3", "--json",
                                 "--verify", "--device", "cpu")
    assert code == 0 and [r["status"] for r in results] == ["ok", "ok"]
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["transport"] == "shm"
    assert json.loads(trace[0])["transport"] == "shm"


def test_a_link_that_joins_after_close_is_hung_up_and_starts_no_thread():
    """A link that finishes joining once its transport closed (a restarted producer's, at the
    end of a run) is not registered and leaves no thread of its own running."""
    class ClosesWhileJoining(GlooTransport):
        def _open_data(self, link, store):  # its group is made, its threads not yet started
            self.close(wait_s=0.0, flush_s=0.0)

    ends = linked_pair(lambda store, rank: (ClosesWhileJoining if rank == 0 else GlooTransport)(
        store, rank, 20), join_s=20)
    close_ends(ends[1:])
    deadline = time.monotonic() + 5
    while _link_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ends[0].closed and ends[0].links == {} and _link_threads() == []


def _link_threads() -> list[str]:
    return [t.name for t in threading.enumerate()
            if t.name in ("pdgpu-send-1", "pdgpu-recv-1") and t.is_alive()]
