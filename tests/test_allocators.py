"""BlockManager and StateSlotAllocator: torch-free bookkeeping with integrity checks."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from engine.block_manager import BlockManager, OutOfBlocks
from engine.state_slots import OutOfSlots, StateOwnershipError, StateSlotAllocator


def test_allocators_import_no_torch():
    # engine/__init__ pulls in torch-backed modules, so load these files under a bare package.
    script = ("import sys, types; pkg = types.ModuleType('engine'); pkg.__path__ = ['engine']; "
              "sys.modules['engine'] = pkg; "
              "import engine.block_manager, engine.state_slots, engine.scheduler, engine.phase; "
              "sys.exit('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[1])
    assert result.returncode == 0, "scheduler / allocators / phase must not import torch"


def test_blocks_grow_and_free():
    bm = BlockManager(num_blocks=6, block_size=4)
    assert bm.allocate("a", 1) == [0]
    assert bm.allocate("a", 4) == [0]  # still fits in one block
    assert bm.allocate("a", 5) == [0, 1]
    bm.allocate("b", 12)
    assert bm.num_free_blocks == 1
    assert not bm.can_allocate("c", 5)
    with pytest.raises(OutOfBlocks, match="needs 2 more KV blocks, 1 free"):
        bm.allocate("c", 5)
    assert bm.free("a") == 2
    assert bm.free("a") == 0  # idempotent
    bm.check_integrity()
    bm.free("b")
    assert bm.num_free_blocks == 6
    bm.check_integrity()


def test_shared_blocks_are_ref_counted():
    bm = BlockManager(num_blocks=4, block_size=2)
    table = bm.allocate("a", 4)
    bm.share("b", table)
    bm.check_integrity()
    bm.free("a")
    assert bm.num_free_blocks == 2  # still held by b
    bm.free("b")
    assert bm.num_free_blocks == 4
    bm.check_integrity()


def test_block_integrity_check_catches_corruption():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 3)
    bm.block_tables["a"].append(3)  # a block the free list still holds
    with pytest.raises(AssertionError):
        bm.check_integrity()


def test_random_block_workload_keeps_integrity():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=32, block_size=4)
    live: dict[str, int] = {}
    for step in range(2000):
        if live and rng.random() < 0.4:
            rid = rng.choice(sorted(live))
            bm.free(rid)
            del live[rid]
        else:
            rid = f"r{step}" if rng.random() < 0.5 or not live else rng.choice(sorted(live))
            want = live.get(rid, 0) + rng.randint(1, 9)
            if bm.can_allocate(rid, want):
                bm.allocate(rid, want)
                live[rid] = want
        bm.check_integrity()
    for rid in list(live):
        bm.free(rid)
    assert bm.num_free_blocks == 32


def test_slots_carry_owner_generations():
    slots = StateSlotAllocator(2)
    s = slots.allocate("a")
    first = slots.owner(s)
    slots.free("a")
    s2 = slots.allocate("a")  # same id, same slot, new ownership
    assert s2 == s and slots.owner(s2) != first and slots.owner(s2).generation > first.generation
    slots.allocate("b")
    with pytest.raises(OutOfSlots):
        slots.allocate("c")
    with pytest.raises(ValueError, match="already holds"):
        slots.allocate("b")
    slots.check_integrity()


def test_state_read_guard():
    slots = StateSlotAllocator(2)
    a = slots.allocate("a")
    with pytest.raises(StateOwnershipError, match="stale or missing"):
        slots.check_readable("a", a)  # allocated but never written
    slots.mark_written("a")
    slots.check_readable("a", a)
    b = slots.allocate("b")
    with pytest.raises(StateOwnershipError, match="owned by"):
        slots.check_readable("b", a)  # someone else's slot
    slots.free("a")
    a2 = slots.allocate("a2")
    assert a2 == a
    with pytest.raises(StateOwnershipError, match="stale or missing"):
        slots.check_readable("a2", a2)  # previous owner's state is still in the tensors
    slots.mark_written("b")
    slots.check_readable("b", b)


def test_freed_table_comes_back_as_ascending_runs():
    """Hand-offs copy one piece per run of consecutive ids: a freed table must not return reversed."""
    bm = BlockManager(num_blocks=12, block_size=4)
    first = list(bm.allocate("a", 16))
    bm.allocate("b", 8)
    bm.free("a")
    bm.allocate("c", 4 * (6 + 4))  # the 6 never-used blocks, then a's 4 in their order
    assert bm.table("c") == [6, 7, 8, 9, 10, 11] + first
    bm.check_integrity()
