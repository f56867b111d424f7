"""The decoder's parts: the ledger decides and records and moves no bytes, the KV landing moves
and checks bytes and decides nothing, and each part reads only state it owns or is handed."""

import ast
import inspect
from pathlib import Path

import networkx as nx
from import_helpers import import_graph

import pdgpu
from pdgpu.serve.decoder import Decoder
from pdgpu.serve.decoder_prefix import DecoderPrefix
from pdgpu.serve.landing import KVLanding
from pdgpu.serve.ledger import Ledger
from pdgpu.serve.postprocess import Postprocess
from pdgpu.serve.recovery import Recovery

GRAPH = import_graph(Path(pdgpu.__file__).parent)
# (state_pool's StateShape, a value the ledger passes on, is not among them)
DATA_PLANE = {"pdgpu.serve.link", "pdgpu.serve.digest", "pdgpu.serve.rendezvous",
              "pdgpu.source_cache"}
AUTHORITY = {"pdgpu.live_check", "pdgpu.audit", "pdgpu.serve.tracelog"}


def _reachable(module: str) -> set[str]:
    return nx.descendants(GRAPH, module)


def test_the_ledger_reaches_the_bytes_only_through_the_landing():
    """serve/ledger.py imports no lane, checksum or cache module itself: only the landing
    does; and the landing imports nothing of the live check, the audit or the trace."""
    direct = set(GRAPH.successors("pdgpu.serve.ledger"))
    assert direct & DATA_PLANE == set()
    assert "pdgpu.serve.landing" in direct
    assert _reachable("pdgpu.serve.landing") & AUTHORITY == set()
    assert _reachable("pdgpu.serve.landing") >= {"pdgpu.serve.link", "pdgpu.serve.digest"}


def _attributes_read_but_not_owned(cls) -> set[str]:
    """`self.NAME` read in `cls`'s methods that neither its __init__ assigns nor the class
    defines (a mixin's reads of its host's attributes)."""
    tree = ast.parse(inspect.getsource(cls))
    owned = {name for name, _ in inspect.getmembers(cls)}
    read = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "self":
            (owned if isinstance(node.ctx, ast.Store) else read).add(node.attr)
    return read - owned


def test_each_part_of_the_decoder_reads_only_what_it_owns_or_is_given():
    """Recovery, the KV landing, the ledger, the postprocess, the decoder's prefix cache and
    the decoder loop each read no attribute that another class creates on them (recovery.py
    once read what decoder.py's __init__ made)."""
    for cls in (Recovery, KVLanding, Ledger, Decoder, Postprocess, DecoderPrefix):
        assert _attributes_read_but_not_owned(cls) == set(), cls.__name__
    assert Recovery not in Decoder.__mro__
