"""The linear-layer state pool: stable slots, zeroed on take, one gather/scatter per layer."""

from __future__ import annotations

import pytest
import torch

from pdgpu.state_pool import StatePool, StateShape, state_views

SHAPE = StateShape(layers=3, conv=(6, 3), recurrent=(2, 4, 5), dtype=torch.float32)


def test_a_taken_slot_is_zeroed_and_growing_keeps_the_others():
    """`take` hands out the lowest free slot zeroed; when the pool doubles, states already
    written stay in their slots."""
    pool = StatePool(SHAPE, 1, "cpu")
    first = pool.take()
    pool.conv[:, first] = 1.0
    pool.recurrent[:, first] = 2.0
    second = pool.take()  # grows the pool
    assert (first, second, pool.slots) == (0, 1, 2)
    assert bool((pool.conv[:, first] == 1).all()) and bool((pool.recurrent[:, first] == 2).all())
    pool.conv[:, second] = 5.0
    pool.give_back(second)
    assert pool.take() == 1 and not bool(pool.conv[:, 1].any())


def test_gather_and_scatter_move_one_layer_of_the_slots_named():
    """A decode batch's read of one layer is the slots' own states in batch order; its write
    lands in those slots and that layer only."""
    pool = StatePool(SHAPE, 4, "cpu")
    for _ in range(4):
        pool.take()
    pool.recurrent.copy_(torch.arange(pool.recurrent.numel(), dtype=torch.float32)
                         .view_as(pool.recurrent))
    slots = torch.tensor([2, 0])
    conv, rec = pool.gather(1, slots)
    assert torch.equal(rec, pool.recurrent[1, [2, 0]])
    before = pool.recurrent.clone()
    pool.scatter(1, slots, conv + 1, rec * 0 - 1)
    assert bool((pool.recurrent[1, [2, 0]] == -1).all())
    assert torch.equal(pool.recurrent[1, [1, 3]], before[1, [1, 3]])
    assert torch.equal(pool.recurrent[[0, 2]], before[[0, 2]])


def test_giving_back_a_slot_not_taken_is_refused():
    """A slot given back twice (or never taken) is an error, not a silent double free."""
    pool = StatePool(SHAPE, 2, "cpu")
    slot = pool.take()
    pool.give_back(slot)
    with pytest.raises(ValueError, match="not taken"):
        pool.give_back(slot)


def test_a_request_state_size_counts_every_linear_layer():
    """Bytes per request: conv window in the model dtype, recurrent matrix in float32, per
    linear layer."""
    shape = StateShape(layers=2, conv=(10, 3), recurrent=(2, 4, 4), dtype=torch.bfloat16)
    assert shape.nbytes == 2 * (10 * 3 * 2 + 2 * 4 * 4 * 4)


def test_a_state_moves_out_and_in_through_bytes_laid_out_by_state_views():
    """copy_out into state_views over a byte buffer and copy_in from it move layers [1, 3)
    of one slot into another pool's slot exactly, other layers untouched."""
    shape = StateShape(layers=3, conv=(6, 3), recurrent=(2, 4, 5), dtype=torch.bfloat16)
    source, target = StatePool(shape, 2, "cpu"), StatePool(shape, 2, "cpu")
    source.conv.copy_(torch.randn(source.conv.shape))
    source.recurrent.copy_(torch.randn(source.recurrent.shape))
    raw = torch.zeros(2 * (6 * 3 * 2 + 2 * 4 * 5 * 4), dtype=torch.uint8)
    views = state_views(shape, 2, raw)
    source.copy_out((1, 3), 1, *views)
    target.copy_in((1, 3), 0, *views)
    assert torch.equal(target.conv[1:, 0], source.conv[1:, 1])
    assert torch.equal(target.recurrent[1:, 0], source.recurrent[1:, 1])
    assert not target.conv[0].any() and not target.recurrent[:, 1].any()
