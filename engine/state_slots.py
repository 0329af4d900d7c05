"""Mamba state-slot allocator with owner tags. No torch: the state tensors live in engine.cache.

Each slot carries an owner tag (request id, generation). The generation increments every time
a slot is handed out, so a stale reference to a previous owner of the same slot can never pass
as the current one. `written_for` records whose state the slot's tensors currently hold; the
model runner checks it before any read of the slot (the debug guard in engine.cache).
"""

from __future__ import annotations

from dataclasses import dataclass


class OutOfSlots(RuntimeError):
    pass


class StateOwnershipError(RuntimeError):
    """A read of a state slot whose contents were not written for the reading request."""


@dataclass(frozen=True)
class SlotOwner:
    request_id: str
    generation: int


class StateSlotAllocator:
    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._owner: list[SlotOwner | None] = [None] * num_slots
        self._written_for: list[SlotOwner | None] = [None] * num_slots
        self._generation = 0
        self.slot_of: dict[str, int] = {}

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self, request_id: str) -> int:
        if request_id in self.slot_of:
            raise ValueError(f"request {request_id!r} already holds slot {self.slot_of[request_id]}")
        if not self._free:
            raise OutOfSlots(f"no free state slot for request {request_id!r}")
        slot = self._free.pop()
        self._generation += 1
        self._owner[slot] = SlotOwner(request_id, self._generation)
        self.slot_of[request_id] = slot
        return slot

    def owner(self, slot: int) -> SlotOwner | None:
        return self._owner[slot]

    def owner_of(self, request_id: str) -> SlotOwner:
        return self._owner[self.slot_of[request_id]]

    def mark_written(self, request_id: str) -> None:
        """The slot's tensors now hold `request_id`'s state (after a prefill step or a hand-off)."""
        slot = self.slot_of[request_id]
        self._written_for[slot] = self._owner[slot]

    def check_readable(self, request_id: str, slot: int) -> None:
        """Raise unless `slot` is `request_id`'s and holds state written for this very ownership."""
        owner = self._owner[slot]
        written = self._written_for[slot]
        if owner is None or owner.request_id != request_id:
            raise StateOwnershipError(
                f"request {request_id!r} would read state slot {slot} owned by {owner}"
            )
        if written is not owner:  # mark_written stores the owner tag itself; generations make tags unique
            raise StateOwnershipError(
                f"request {request_id!r} would read state slot {slot} whose contents were written "
                f"for {written} (current owner {owner}): stale or missing state"
            )

    def free(self, request_id: str) -> bool:
        """Release `request_id`'s slot; unknown ids are a no-op so aborts can call it freely."""
        slot = self.slot_of.pop(request_id, None)
        if slot is None:
            return False
        self._owner[slot] = None
        self._written_for[slot] = None
        self._free.append(slot)
        return True

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("free slot list holds duplicates")
        for request_id, slot in self.slot_of.items():
            owner = self._owner[slot]
            if owner is None or owner.request_id != request_id:
                raise AssertionError(f"slot {slot} mapped to {request_id!r} but owned by {owner}")
            if slot in free:
                raise AssertionError(f"slot {slot} is both free and held by {request_id!r}")
        if len(free) + len(self.slot_of) != self.num_slots:
            raise AssertionError("slots are neither free nor held")
