"""Sample <-> storage rows: token fields as numpy arrays, never Python lists.

A *row* is one sample's data in a storage unit: ``{"uid", "group_id"}`` plus any
subset of the sample fields below. Token fields are 1-D numpy arrays (int32 ids,
float32 log-probs, int32 versions); scalar fields stay Python values.

Across processes (Ray) rows travel *packed*: each token field of a chunk of rows
is one flat array plus offsets, so a batch of 256 x 1,024 tokens is a handful of
buffers that go through the object store without pickling a Python object per token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import numpy as np

from transfer_queue.sample import Sample
from transfer_queue.wire import SampleTags

__all__ = [
    "ALL_FIELDS",
    "FULL_MASK",
    "Packed",
    "SCALAR_FIELDS",
    "TOKEN_FIELDS",
    "fields_mask",
    "mask_fields",
    "pack_rows",
    "row_to_sample",
    "sample_to_row",
    "tags_of",
    "unpack_rows",
]

TOKEN_FIELDS: dict[str, type] = {
    "prompt_ids": np.int32,
    "response_ids": np.int32,
    "rollout_logprobs": np.float32,
    "token_versions": np.int32,
}
SCALAR_FIELDS: tuple[str, ...] = (
    "reward",
    "finish_reason",
    "num_resumes",
    "meta",
    "created_s",
    "finished_s",
    "error",
)
ALL_FIELDS: tuple[str, ...] = (*TOKEN_FIELDS, *SCALAR_FIELDS)
_BIT = {name: 1 << i for i, name in enumerate(ALL_FIELDS)}
FULL_MASK = (1 << len(ALL_FIELDS)) - 1


def fields_mask(fields: Iterable[str] | None) -> int:
    """Bit set of ``fields`` (``None`` = every sample field); ValueError names an unknown one."""
    if fields is None:
        return FULL_MASK
    mask = 0
    for name in fields:
        bit = _BIT.get(name)
        if bit is None:
            raise ValueError(f"unknown sample field {name!r}; fields are {ALL_FIELDS}")
        mask |= bit
    return mask


def mask_fields(mask: int) -> tuple[str, ...]:
    return tuple(name for name in ALL_FIELDS if mask & _BIT[name])


def sample_to_row(sample: Sample, fields: Sequence[str]) -> dict[str, Any]:
    """The named fields of ``sample`` as a storage row (token lists become numpy arrays)."""
    row: dict[str, Any] = {"uid": sample.uid, "group_id": sample.group_id}
    for name in fields:
        value = getattr(sample, name)
        dtype = TOKEN_FIELDS.get(name)
        # asarray: a list is converted once; an array of the right dtype (an engine's
        # output handed over as is) is kept without a copy.
        row[name] = np.asarray(value, dtype=dtype) if dtype is not None else value
    return row


def tags_of(row: dict[str, Any], mask: int) -> SampleTags:
    """The controller's tags for a row (lengths and versions from the arrays, no Python loops)."""
    versions = row.get("token_versions")
    has_versions = versions is not None and versions.size > 0
    prompt, response = row.get("prompt_ids"), row.get("response_ids")
    return SampleTags(
        uid=row["uid"],
        group_id=row["group_id"],
        mask=mask,
        min_version=int(versions.min()) if has_versions else -1,
        max_version=int(versions.max()) if has_versions else -1,
        num_prompt_tokens=-1 if prompt is None else int(prompt.size),
        num_response_tokens=-1 if response is None else int(response.size),
    )


def row_to_sample(row: dict[str, Any]) -> Sample:
    """A ``Sample`` from a row; fields the row lacks keep the Sample defaults."""
    kwargs: dict[str, Any] = {"uid": row["uid"], "group_id": row["group_id"]}
    for name, value in row.items():
        if name in TOKEN_FIELDS:
            kwargs[name] = value.tolist()
        elif name in _BIT:
            kwargs[name] = value
    kwargs.setdefault("prompt_ids", [])
    return Sample(**kwargs)


class Packed(msgspec.Struct, kw_only=True):
    """Rows of one storage unit, packed for transport: one flat buffer per token field.

    ``tokens[name] = (flat, offsets)`` with ``flat[offsets[i]:offsets[i+1]]`` the
    field of row i (offsets int64, length n+1). ``scalars`` is the msgpack of a
    list of per-row dicts of the scalar fields present.
    """

    indices: list[int]
    uids: list[str]
    group_ids: list[str]
    tokens: dict[str, tuple[Any, Any]]
    scalars: bytes


_encoder = msgspec.msgpack.Encoder()
_scalars_decoder = msgspec.msgpack.Decoder(list[dict[str, Any]])


def pack_rows(indices: Sequence[int], rows: Sequence[dict[str, Any]]) -> Packed:
    """Pack rows that carry the same fields (one put, or one get's requested fields)."""
    assert len(indices) == len(rows)
    names = [k for k in rows[0] if k in TOKEN_FIELDS] if rows else []
    tokens: dict[str, tuple[Any, Any]] = {}
    for name in names:
        arrays = [r[name] for r in rows]
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum([a.size for a in arrays], out=offsets[1:])
        tokens[name] = (np.concatenate(arrays) if arrays else np.empty(0, TOKEN_FIELDS[name]), offsets)
    scalars = [{k: v for k, v in r.items() if k in _BIT and k not in TOKEN_FIELDS} for r in rows]
    return Packed(
        indices=list(indices),
        uids=[r["uid"] for r in rows],
        group_ids=[r["group_id"] for r in rows],
        tokens=tokens,
        scalars=_encoder.encode(scalars),
    )


def unpack_rows(packed: Packed) -> list[dict[str, Any]]:
    """Rows from a Packed chunk; token fields are views into its flat buffers (no copy)."""
    scalars = _scalars_decoder.decode(packed.scalars)
    rows = []
    for i, (uid, group_id) in enumerate(zip(packed.uids, packed.group_ids)):
        row: dict[str, Any] = {"uid": uid, "group_id": group_id, **scalars[i]}
        for name, (flat, offsets) in packed.tokens.items():
            row[name] = flat[offsets[i] : offsets[i + 1]]
        rows.append(row)
    return rows
