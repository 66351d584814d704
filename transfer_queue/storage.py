"""A storage unit: sample data by global index, no metadata beyond uid and group id.

Rows are dicts of field -> value, token fields as 1-D numpy arrays (see
``codec.py``). Fields of one sample may arrive in several writes (prompt first,
response later); a later write adds to (or replaces fields of) the row.
The controller decides what is ready and when a row may be freed.

In-process the client passes rows (no copy); across processes it passes
``Packed`` chunks, and rows keep zero-copy views into them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transfer_queue.codec import Packed, pack_rows, unpack_rows

__all__ = ["StorageUnit"]

_IDENTITY = ("uid", "group_id")


class StorageUnit:
    """The rows whose global index maps to this unit (``index % num_storage_units``)."""

    def __init__(self, unit_id: int) -> None:
        self.unit_id = unit_id
        self._rows: dict[int, dict[str, Any]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def put_rows(self, indices: Sequence[int], rows: Sequence[dict[str, Any]]) -> None:
        """Store (or add fields to) the rows at ``indices``; the unit owns the dicts afterwards."""
        for index, row in zip(indices, rows, strict=True):
            have = self._rows.get(index)
            if have is None:
                self._rows[index] = row
            else:
                have.update(row)

    def get_rows(self, indices: Sequence[int], fields: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """The rows at ``indices`` with ``fields`` (None: every field present); arrays are shared, not copied."""
        try:
            if fields is None:
                return [dict(self._rows[i]) for i in indices]
            keys = (*_IDENTITY, *fields)
            return [{k: row[k] for k in keys} for row in map(self._rows.__getitem__, indices)]
        except KeyError as e:
            raise LookupError(f"storage unit {self.unit_id} has no row or field {e.args[0]!r}") from None

    def delete(self, indices: Sequence[int]) -> None:
        """Free the rows at ``indices`` (missing ones are ignored: freeing is idempotent)."""
        for i in indices:
            self._rows.pop(i, None)

    def clear(self) -> None:
        self._rows.clear()

    def num_bytes(self) -> int:
        """Bytes of token data held (numpy buffers only)."""
        return sum(v.nbytes for row in self._rows.values() for v in row.values() if hasattr(v, "nbytes"))

    # Across processes: the same, packed.
    def put_packed(self, packed: Packed) -> None:
        self.put_rows(packed.indices, unpack_rows(packed))

    def get_packed(self, indices: Sequence[int], fields: Sequence[str] | None) -> Packed:
        return pack_rows(indices, self.get_rows(indices, fields))
