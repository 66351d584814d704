"""Where the controller places new samples among the storage units, and which
units lost their rows.

A put's new samples all go to one storage unit (round robin over puts), so a
write is one message: global index = slot * num_units + unit. ``allocate`` hands
whole blocks of slots to Ray clients, which place their samples themselves.

A unit whose actor died is *down*: new samples go to the others until
``replaced`` says a new, empty actor serves it. Slots of unit u below
``lost_below[u]`` were on an actor that died (their rows are gone); slots from
there on are its replacement's.
"""

from __future__ import annotations

from transfer_queue.errors import StorageUnitLost

__all__ = ["UnitMap"]


class UnitMap:
    """Slots handed out per storage unit, and the units lost and replaced."""

    def __init__(self, num_units: int) -> None:
        self.num_units = num_units
        self._next_slot = [0] * num_units
        self._next_unit = 0
        self._down: set[int] = set()  # no actor now: new samples go to the others
        self._lost_below: dict[int, int] = {}  # unit -> its first slot after the last loss
        self._generation = [0] * num_units  # per unit: replacements so far

    @property
    def any_lost(self) -> bool:
        """Whether some unit ever lost its rows (else no index can be on a lost actor)."""
        return bool(self._lost_below)

    def next_unit(self) -> int:
        """The unit a put's new samples go to: the next live one, round robin over puts."""
        n = self.num_units
        live = [u for u in range(n) if u not in self._down]
        if not live:
            raise StorageUnitLost(-1, "every storage unit of this TransferQueue is gone")
        unit = self._next_unit
        if unit in self._down:
            unit = min(live, key=lambda u: (u - unit) % n)  # the next live one
        self._next_unit = (unit + 1) % n
        return unit

    def take_index(self, unit: int) -> int:
        """The global index of ``unit``'s next slot, handed out."""
        index = self._next_slot[unit] * self.num_units + unit
        self._next_slot[unit] += 1
        return index

    def check_block(self, index: int) -> None:
        """Refuse an index of a client's block (all on one unit) that an actor now dead held."""
        if self._lost_below and self.on_lost(index):
            raise StorageUnitLost(index % self.num_units, f"index {index} is of a block allocated before its "
                                  "storage unit was lost; take a new block (its replacement's)")

    def allocate(self, unit: int, num_slots: int) -> int:
        """Hand a client the next ``num_slots`` slots of storage unit ``unit``; returns the first.

        Slot ``k`` is global index ``k * num_units + unit``. Indices are never
        reused, so a block's unused slots are simply skipped.
        """
        if not 0 <= unit < self.num_units or num_slots < 1:
            raise ValueError(f"allocate needs a unit in [0, {self.num_units}) and num_slots >= 1")
        start = self._next_slot[unit]
        self._next_slot[unit] += num_slots
        return start

    def lose(self, unit: int, generation: int | None) -> bool:
        """Storage unit ``unit``'s actor of ``generation`` (None: the current one) died, with
        every slot handed out so far (clients' blocks too). False when that is no news: the
        loss is known already, or the report is about an actor already replaced."""
        if not 0 <= unit < self.num_units:
            raise ValueError(f"unit_lost needs a unit in [0, {self.num_units}), got {unit}")
        if unit in self._down or generation not in (None, self._generation[unit]):
            return False
        self._down.add(unit)
        self._lost_below[unit] = self._next_slot[unit]
        return True

    def replaced(self, unit: int) -> int:
        """A new, empty actor serves lost unit ``unit``: it takes new samples again, in slots
        from the lost ones' end on. Returns its generation."""
        assert unit in self._down, f"storage unit {unit} is not lost: nothing to replace"
        self._down.discard(unit)
        self._generation[unit] += 1
        return self._generation[unit]

    def state(self, unit: int) -> tuple[int, int, bool]:
        """Unit ``unit``'s generation (replacements so far), its first slot (the rows of
        slots below were lost), and whether an actor serves it now."""
        return self._generation[unit], self._lost_below.get(unit, 0), unit not in self._down

    def on_lost(self, index: int) -> bool:
        """Whether the row of global ``index`` was on a storage unit's actor that died."""
        n = self.num_units
        below = self._lost_below.get(index % n)
        return below is not None and index // n < below
