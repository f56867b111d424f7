"""The decoder's view of its producers: which are serving, which died, which are rejoining.

A producer is declared dead when its link breaks (gloo sees the socket close), its local
process exited, a send to it failed, or nothing came from it for `--heartbeat-timeout`
seconds (it sends a `beat` every quarter of that): its link is torn down (nothing it still
sends is taken) and its process, when local, is killed, so its writers have stopped for good.
With `--restart-producers` a local producer is respawned at once and joins a new link (the
next generation) with a new handshake while the others keep serving: `joined` -> setup ->
hello (its capabilities) -> go -> ready, then clock probes (clock.py) relate its clock to ours.
"""

from __future__ import annotations

import enum
import time

import attrs

from pdgpu.serve.clock import PROBES, ClockSample, best
from pdgpu.serve.config import Capabilities, ServeConfig, refusal
from pdgpu.serve.status import say
from pdgpu.serve.transport import Message, TransportError


class PeerState(enum.Enum):
    JOINING = "joining"
    READY = "ready"
    DEAD = "dead"


@attrs.define
class Peer:
    rank: int
    offset: float  # this producer's clock + offset = the decoder's perf_counter
    generation: int = 0
    state: PeerState = PeerState.READY
    last_seen: float = attrs.Factory(time.perf_counter)
    probes: list[float] = attrs.Factory(list)  # when the clock probes not yet answered left
    clock: ClockSample | None = None  # the best round trip so far (None: `ready`'s estimate)

    def on_clock(self, now: float, received: float) -> None:
        """An answer to the oldest probe: the offset from the best round trip so far."""
        if not self.probes:
            return
        sample = ClockSample(self.probes.pop(0), now, received)
        self.clock = best([sample] if self.clock is None else [self.clock, sample])
        self.offset = self.clock.offset


HANDSHAKE = ("joined", "hello", "ready", "clock")  # from a joining producer
JOIN_OPS = ("setup", "go", "refuse")  # to it


class Members:
    def __init__(self, transport, config: ServeConfig, offsets: dict[int, float],
                 heartbeat_timeout: float, join_timeout: float, processes=None,
                 restart: bool = False, device: str = "cpu") -> None:
        self.transport, self.config, self.processes = transport, config, processes
        self.device = device  # the decoder's: a rejoining producer on another kind is refused
        self.heartbeat_timeout, self.join_timeout = heartbeat_timeout, join_timeout
        self.restart = restart and processes is not None
        self.peers = {rank: Peer(rank, offset) for rank, offset in offsets.items()}
        self.broken: dict[int, str] = {}  # rank -> why a send to its current link failed
        self.deaths = self.restarts = self.kills = 0

    def ready(self) -> list[int]:
        return [r for r, p in self.peers.items() if p.state is PeerState.READY]

    def alive(self, rank: int) -> bool:
        """Serving or joining (not declared dead)."""
        peer = self.peers.get(rank)
        return peer is not None and peer.state is not PeerState.DEAD

    def can_serve(self) -> bool:
        """A producer serves now or may again (one is rejoining, or restarts are on)."""
        return self.restart or any(p.state is not PeerState.DEAD for p in self.peers.values())

    def offset(self, rank: int) -> float:
        return self.peers[rank].offset

    def seen(self, rank: int) -> None:
        self.peers[rank].last_seen = time.perf_counter()

    def send(self, rank: int, op: str, body: dict) -> None:
        """Send to a serving producer (a joining one gets its handshake only); a failure
        marks it for `due_deaths` (never raises)."""
        state = self.peers[rank].state
        if state is PeerState.DEAD or (state is PeerState.JOINING and op not in JOIN_OPS):
            return
        try:
            self.transport.send(rank, op, body)
        except TransportError as e:
            self.broken.setdefault(rank, str(e))

    # -- deaths -----------------------------------------------------------------------------

    def due_deaths(self) -> dict[int, str]:
        """Producers to declare dead now, with the reason."""
        now, due = time.perf_counter(), dict(self.broken)
        exited = self.processes.exited() if self.processes is not None else {}
        for rank, peer in self.peers.items():
            if peer.state is PeerState.DEAD or rank in due:
                continue
            if rank in exited:
                due[rank] = f"producer p{rank} exited with code {exited[rank]}"
            elif peer.state is PeerState.READY and now - peer.last_seen > self.heartbeat_timeout:
                due[rank] = f"producer p{rank} silent for {self.heartbeat_timeout:g} s"
            elif peer.state is PeerState.JOINING and now - peer.last_seen > self.join_timeout:
                due[rank] = f"producer p{rank} did not rejoin within {self.join_timeout:g} s"
        self.broken.clear()
        return due

    def declare_dead(self, rank: int, reason: str = "") -> None:
        """Tear its link down and stop its process; respawn it when restarts are on. Said on
        stderr: a death changes what the run can do, and a log must show when and why."""
        peer = self.peers[rank]
        first = (reason or "its link broke").splitlines()[0].split(". ")[0]  # gloo's advice
        say(f"producer p{rank} declared dead: {first}")
        self.broken.pop(rank, None)  # about the link torn down here, not the next one
        self.transport.drop(rank)
        if self.processes is not None:
            self.processes.kill(rank)
        if peer.state is PeerState.READY:
            self.deaths += 1
        peer.state = PeerState.DEAD
        if self.restart:
            self._respawn(peer)

    def _respawn(self, peer: Peer) -> None:
        peer.generation += 1
        peer.state, peer.last_seen = PeerState.JOINING, time.perf_counter()
        say(f"producer p{peer.rank} restarting (generation {peer.generation})")
        self.processes.respawn(peer.rank, peer.generation)
        self.transport.connect_async(peer.rank, peer.generation)
        self.restarts += 1

    def kill(self, index: int) -> None:
        """`--kill-producer`: SIGKILL producer index `index` if it serves (found later)."""
        peer = self.peers.get(index + 1)
        if peer is not None and peer.state is PeerState.READY and self.processes is not None:
            self.processes.kill(peer.rank)
            self.kills += 1

    # -- rejoining ----------------------------------------------------------------------------

    def on_handshake(self, msg: Message) -> None:
        """One step of a respawned producer's handshake."""
        peer = self.peers[msg.src]
        if msg.op == "clock":
            peer.on_clock(msg.body["now"], time.perf_counter())
            return
        if peer.state is not PeerState.JOINING:
            return
        if msg.op == "joined":
            self.send(peer.rank, "setup", {"config": self.config.to_json()})
        elif msg.op == "hello":
            reason = refusal(self.config.mode, [Capabilities.from_json(msg.body["caps"])],
                             self.device)
            self.send(peer.rank, "refuse" if reason else "go", {"reason": reason})
            if reason is not None:
                self.restart = False  # it would be refused again: serve with the others
                self.broken[peer.rank] = f"producer p{peer.rank} refused: {reason}"
        elif msg.op == "ready":
            peer.offset = time.perf_counter() - msg.body["now"]  # until a probe answers
            peer.state, peer.clock, peer.probes = PeerState.READY, None, []
            say(f"producer p{peer.rank} rejoined (generation {peer.generation}): serving")
            for _ in range(PROBES):  # answered in order (one link: FIFO both ways)
                peer.probes.append(time.perf_counter())
                self.send(peer.rank, "clock", {})
