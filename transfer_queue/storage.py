"""A storage unit: sample data by global index, no metadata beyond uid and group id.

Rows are dicts of field -> value (see ``codec.py``): Python values in process,
``msgspec.Raw`` msgpack slices in a storage actor, which never parses the tokens.
Fields of one sample may arrive in several writes (prompt first, response later);
a later write adds to (or replaces fields of) the row. The controller decides what is ready and when a row may be freed.

In-process the client passes rows (no copy); across processes it passes one
msgpack buffer per write and gets one back per read (``put_encoded``/``get_encoded``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transfer_queue.codec import decode_raw_rows, encode_rows

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
        """The rows at ``indices`` with ``fields`` (None: every field present); values are shared, not copied."""
        try:
            if fields is None:
                return [dict(self._rows[i]) for i in indices]
            keys = (*_IDENTITY, *fields)
            return [{k: row[k] for k in keys} for row in map(self._rows.__getitem__, indices)]
        except KeyError as e:
            raise LookupError(f"storage unit {self.unit_id} has no row or field {e.args[0]!r}") from None

    def has(self, index: int) -> bool:
        return index in self._rows

    def delete(self, indices: Sequence[int]) -> None:
        """Free the rows at ``indices`` (missing ones are ignored: freeing is idempotent)."""
        for i in indices:
            self._rows.pop(i, None)

    def clear(self) -> None:
        self._rows.clear()

    def num_bytes(self) -> int:
        """Bytes of sample data held, as msgpack (what a storage actor holds; in process, its encoded size)."""
        return sum(len(encode_rows([row])) for row in self._rows.values())

    # Across processes: the same, one msgpack buffer per call.
    def put_encoded(self, indices: Sequence[int], buf: bytes) -> None:
        self.put_rows(indices, decode_raw_rows(buf))

    def get_encoded(self, indices: Sequence[int], fields: Sequence[str] | None) -> bytes:
        return encode_rows(self.get_rows(indices, fields))
