"""Counting what a forward dispatches: kernel ops (what a GPU would launch), host syncs and
tensors made from nothing, on any device (a TorchDispatchMode: no GPU needed); the bytes
a call copies (`bytes_copied`: what the serving decoder's admission moves, for instance); and
the most bytes a call holds at once (`peak_bytes`: a decode bucket's growth, for instance).

Views (and `_unsafe_view`) launch nothing and are not counted. Convention for CPU: torch's
`rms_norm` counts as one op, as on CUDA, where it is one fused kernel (`_fused_rms_norm`);
torch's CPU build decomposes it into six, and `cpu_ops` keeps that figure too. On CUDA no
convention applies: every dispatched op counts.

Per-layer figures are marginal: the same step with 3 layers minus with 2 (`per_layer`), so
what runs once per step (embedding, RoPE tables, masks, the head) is apart.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import attrs
import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

FREE = {"aten._unsafe_view.default", "aten.detach.default"}
HOST_DATA = {"aten.lift_fresh.default"}  # torch.tensor(data)
SYNCS = ("_local_scalar_dense", "nonzero", "is_nonzero", "masked_select", "unique", "equal")
FUSED_ON_CUDA = (F.rms_norm, torch.rms_norm)


class OpCount(NamedTuple):
    """One call's counts."""

    kernels: int  # ops a GPU launches (rms_norm as one)
    cpu_ops: int  # ops the CPU build dispatches (rms_norm decomposed)
    syncs: int  # host reads of tensor values (.item, nonzero ...; a CPU tensor's .tolist
    # reads memory without dispatching: seen on CUDA only, as a copy to the host)
    made: int  # tensors made from no tensor (factories, torch.tensor of host data)
    names: Counter  # kernel op -> count

    def __sub__(self, other: OpCount) -> OpCount:
        return OpCount(self.kernels - other.kernels, self.cpu_ops - other.cpu_ops,
                       self.syncs - other.syncs, self.made - other.made,
                       self.names - other.names)


class _Dispatched(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.kernels, self.cpu_ops, self.syncs, self.made = 0, 0, 0, 0
        self.names: Counter = Counter()
        self.fused = 0  # > 0 inside an op counted as one fused kernel

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name in HOST_DATA:  # an alias of a tensor made from host data
            self.made += 1
        elif name.startswith("aten.") and not func.is_view and name not in FREE:
            self.cpu_ops += 1
            self.syncs += any(s in name for s in SYNCS) or _to_host(name, args, kwargs)
            self.made += _from_nothing(args, kwargs)
            if not self.fused:
                self.kernels += 1
                self.names[name] += 1
        return func(*args, **kwargs)


class _Copied(TorchDispatchMode):
    """Sums the floating-point bytes each op writes from values it reads from a tensor (K/V
    and state; integer bookkeeping such as slot indices and fills are not copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not func.is_view and str(func) not in FREE:
            written = _written(func, args, kwargs, out)
            if any(t is not w for t in _tensors((args, kwargs)) for w in written):
                self.bytes += sum(w.numel() * w.element_size() for w in written
                                  if w.is_floating_point())
        return out


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in torch.utils._pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _written(func, args, kwargs, out) -> list[torch.Tensor]:
    """The tensors an op writes, as many bytes as it writes: its `out=`; of an in-place op
    its source (`source`, `values`, `src`: an indexed write writes that many) or else its
    first argument; else what it returns."""
    schema = func._schema
    if "out" in kwargs:
        return _tensors(kwargs["out"])
    first = schema.arguments[0] if schema.arguments else None
    if first is None or first.alias_info is None or not first.alias_info.is_write:
        return _tensors(out)
    names = [a.name for a in schema.arguments]
    for name in ("source", "values", "src"):
        if name in names:
            at = names.index(name)
            return _tensors(kwargs[name] if name in kwargs else args[at])
    return _tensors(args[0])


@torch.no_grad()
def bytes_copied(fn, *args, **kwargs) -> tuple[object, int]:
    """fn(*args, **kwargs)'s result and the floating-point bytes it copied (see _Copied)."""
    seen = _Copied()
    with seen:
        result = fn(*args, **kwargs)
    return result, seen.bytes


class _Held(TorchDispatchMode):
    """Follows the bytes of live storages: those `held` at the start and every one an op
    makes (not an alias of its inputs'), each counted until it is freed (a storage's
    Python object lives exactly as long as its memory, so a finalizer sees it go); `peak`
    is the most at any moment."""

    def __init__(self, held: Callable[[], list[torch.Tensor]]) -> None:
        super().__init__()
        self.seen: set[int] = set()
        self.live = self.peak = 0
        for storage in {id(t.untyped_storage()): t.untyped_storage() for t in held()}.values():
            self._follow(storage)

    def _follow(self, storage) -> None:
        if id(storage) not in self.seen:
            self.seen.add(id(storage))
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, id(storage), storage.nbytes())

    def _freed(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = {id(t.untyped_storage()) for t in _tensors((args, kwargs))}
        for tensor in _tensors(out):
            if id(tensor.untyped_storage()) not in given:
                self._follow(tensor.untyped_storage())
        return out


@torch.no_grad()
def peak_bytes(fn, *args, held: Callable[[], list[torch.Tensor]], **kwargs) -> tuple[object, int]:
    """fn(*args, **kwargs)'s result and the most bytes held at once while it ran: the
    storages of the tensors `held()` names (a function, so that no list of them outlives
    the call into `fn`), each until freed, plus each one an op made, until freed (a
    kernel's own scratch is not seen)."""
    seen = _Held(held)
    with seen:
        result = fn(*args, **kwargs)
    return result, seen.peak


def _to_host(name: str, args, kwargs) -> bool:
    """A copy from a device tensor into host memory (the host waits for it)."""
    if name == "aten._to_copy.default":
        return args[0].device.type != "cpu" and str(kwargs.get("device", "")) == "cpu"
    if name == "aten.copy_.default":
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    return False


def _from_nothing(args, kwargs) -> bool:
    """An op none of whose arguments is a tensor makes a new tensor from host values."""
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    return not any(isinstance(x, torch.Tensor) for x in leaves)


class _FusedOnCuda(TorchFunctionMode):
    """Counts rms_norm as one kernel when its input is not on CUDA."""

    def __init__(self, dispatched: _Dispatched) -> None:
        super().__init__()
        self.dispatched = dispatched

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in FUSED_ON_CUDA or args[0].device.type == "cuda":
            return func(*args, **kwargs)
        self.dispatched.kernels += 1
        self.dispatched.names["aten.rms_norm (one kernel on CUDA)"] += 1
        self.dispatched.fused += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.dispatched.fused -= 1


@torch.no_grad()
def count_ops(fn, *args, **kwargs) -> OpCount:
    """Run fn(*args, **kwargs) once and count what it dispatched."""
    seen = _Dispatched()
    with _FusedOnCuda(seen), seen:
        fn(*args, **kwargs)
    return OpCount(seen.kernels, seen.cpu_ops, seen.syncs, seen.made, seen.names)


def per_layer(spec, measure) -> tuple[OpCount, OpCount]:
    """(per layer, once per call) of `measure(spec) -> OpCount`, from 2- and 3-layer models
    of the spec's shapes."""
    two = measure(attrs.evolve(spec, layers=2))
    three = measure(attrs.evolve(spec, layers=3))
    layer = three - two
    return layer, two - layer - layer


def decode_step_ops(spec, contexts, device="cpu") -> OpCount:
    """A decode step of requests with `contexts` tokens each (random weights, zero K/V and
    state), counted after a first step (the steady state)."""
    from pdgpu.decode_batch import DecodeBatch, decode_logits
    from pdgpu.decode_kv import DecodeCache
    from pdgpu.model import build_model
    model = build_model(spec, device, seed=0)
    cache = DecodeCache.for_model(model)
    state = None if cache.states is None else cache.states.read(cache.scratch)  # zeroed
    seqs = [cache.add(torch.zeros(len(model.arch.kv_layers), 2, n, spec.kv_heads,
                                  spec.head_dim, dtype=cache.dtype, device=device), state)
            for n in contexts]
    batch = DecodeBatch(seqs)
    batch.feed([1] * len(seqs))
    with torch.no_grad():
        decode_logits(model, batch)
    return count_ops(decode_logits, model, batch)


def prefill_chunk_ops(spec, chunk: int, start: int, digests: bool = True,
                      device="cpu") -> OpCount:
    """A prefill chunk of `chunk` tokens at `start` into a paged source cache, with the
    serving producer's compute-time digests when `digests`."""
    from pdgpu.model import build_model, torch_dtype
    from pdgpu.serve.digest import DigestingKV
    from pdgpu.source_cache import SourceCache
    model = build_model(spec, device, seed=0)
    geometry, end = spec.geometry(16), start + chunk
    cache = SourceCache(geometry, geometry.pages_for(end), device, torch_dtype(spec))
    kv = cache.open(end)
    if digests:
        kv = DigestingKV(kv, spec.layers, end, device)
    ids = torch.zeros(end, dtype=torch.int64, device=device)
    with torch.no_grad():
        model.prefill_chunk(ids[:end], 0, kv)  # warm: the digest weights are made once
    return count_ops(model.prefill_chunk, ids[start:], start, kv)
