"""What a deployment's ``read`` returns: a batch's rows, turned into Samples on demand.

``get`` must stay cheap (a lease and a handle on the data), so Sample objects,
whose millions of Python ints are the real cost of a batch, are built only when
the consumer asks (``Batch.samples``), and once.

    InProcessRows   rows shared with the in-process storage units (no copy until read)
    EncodedRows     one msgpack buffer per storage unit, as a storage actor sent it
                    (bytes, or a uint8 array over a reply the storage unit sent)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from transfer_queue.codec import TOKEN_FIELDS, decode_field, decode_identities, decode_samples, row_to_sample
from contracts.sample import Sample

__all__ = ["EncodedRows", "InProcessRows", "Rows"]

Buffer = bytes | memoryview | np.ndarray  # what msgspec decodes from: anything bytes-like


class Rows(Protocol):
    """A batch's rows in batch order."""

    def __len__(self) -> int: ...

    def identities(self) -> list[tuple[str, str]]:
        """``(uid, group_id)`` per row, without building the samples."""
        ...

    def samples(self) -> list[Sample]:
        """A new ``Sample`` per row (the caller caches it)."""
        ...

    def column(self, name: str, samples: list[Sample] | None) -> list[np.ndarray]:
        """Token field ``name`` of every row as numpy (``samples``: already built, reuse them)."""
        ...


class InProcessRows:
    """Row dicts of the in-process storage units (their lists are shared until ``samples``)."""

    __slots__ = ("_rows",)

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def identities(self) -> list[tuple[str, str]]:
        return [(r["uid"], r["group_id"]) for r in self._rows]

    def samples(self) -> list[Sample]:
        return [row_to_sample(r) for r in self._rows]

    def column(self, name: str, samples: list[Sample] | None) -> list[np.ndarray]:
        dtype = TOKEN_FIELDS[name]
        return [np.array(r[name], dtype) for r in self._rows]


class EncodedRows:
    """Rows as the storage actors sent them: ``parts[k] = (positions in the batch, msgpack buffer)``.

    Every buffer carries the fields of ``mask`` (a get asks all units for the same fields).
    """

    __slots__ = ("_num_rows", "_parts", "_mask")

    def __init__(self, num_rows: int, parts: Sequence[tuple[Sequence[int], Buffer]], mask: int) -> None:
        self._num_rows, self._parts, self._mask = num_rows, parts, mask

    def __len__(self) -> int:
        return self._num_rows

    def _in_order(self, decode: Any) -> list:
        if len(self._parts) == 1:  # one unit: its rows are already in batch order
            return decode(self._parts[0][1])
        out: list[Any] = [None] * self._num_rows
        for positions, buf in self._parts:
            for pos, item in zip(positions, decode(buf), strict=True):
                out[pos] = item
        return out

    def identities(self) -> list[tuple[str, str]]:
        return self._in_order(decode_identities)

    def samples(self) -> list[Sample]:
        return self._in_order(lambda buf: decode_samples(buf, self._mask))

    def column(self, name: str, samples: list[Sample] | None) -> list[np.ndarray]:
        dtype = TOKEN_FIELDS[name]
        if samples is not None:
            return [np.asarray(getattr(s, name), dtype) for s in samples]  # an array put as one: no copy
        # Only this field is parsed: no whole Sample per row.
        return self._in_order(lambda buf: decode_field(buf, name))
