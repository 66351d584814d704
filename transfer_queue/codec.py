"""Sample <-> storage rows, and rows <-> msgpack for the trip to a storage actor.

A *row* is one sample's data in a storage unit: ``{"uid", "group_id"}`` plus any
subset of the sample fields below, as the ``Sample`` holds them. A token field
is a Python list or a 1-D numpy array (what an engine hands over), and stays
what it was: in-process a row holds a copy of it (a producer may keep
appending to its sample); a list is never turned into an array nor an array
into a list on the way in, because for 1k-token fields that conversion costs
more than everything else a put/get does.

Across processes (Ray) the rows of one storage unit travel as *one* msgpack
buffer: a list as a msgpack array (msgspec encodes ``list[int]`` at C speed),
an array as msgpack ``bin`` holding its little-endian bytes in the field's
dtype (``TOKEN_FIELDS``), so no Python object per token exists on either side.
The storage actor keeps each field as ``msgspec.Raw`` (a slice of that buffer,
never parsed) and answers a read with one buffer of the requested rows.
``Batch.samples`` decodes it into ``Sample`` structs whose token fields are
what was put: lists, or read-only arrays read in place from the buffer
(``decode_samples``); ``Batch.column`` gives one field of each row as a numpy
array (``decode_field``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
import numpy as np

from contracts.sample import TOKEN_DTYPES, Sample, max_version_of, min_version_of
from transfer_queue.wire import SampleTags

__all__ = [
    "ALL_FIELDS",
    "FULL_MASK",
    "SCALAR_FIELDS",
    "TOKEN_FIELDS",
    "decode_field",
    "decode_identities",
    "decode_new_rows",
    "decode_raw_row",
    "decode_raw_rows",
    "decode_samples",
    "decode_tags",
    "encode_new_rows",
    "encode_new_samples",
    "encode_rows",
    "encode_tags",
    "frame_rows",
    "fields_mask",
    "mask_fields",
    "row_to_sample",
    "sample_to_row",
    "tags_of",
]

# Token fields and the dtype they have as arrays (stored, and from ``Batch.column``).
TOKEN_FIELDS = TOKEN_DTYPES
# The same, little-endian: what a token array travels as.
_LE_DTYPES = {name: np.dtype(dtype).newbyteorder("<") for name, dtype in TOKEN_FIELDS.items()}
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


def _token_copy(value: Any, name: str) -> list | np.ndarray:
    """A copy of token field ``name``: a list stays a list (ints and floats are immutable,
    so a shallow copy is a full one, and cheap); anything else (a numpy array)
    becomes a contiguous little-endian array of the field's dtype."""
    if isinstance(value, list):
        return list(value)
    array = np.array(value, dtype=_LE_DTYPES[name], copy=True)
    if array.ndim != 1:
        raise ValueError(f"token field {name!r} must be a list or a 1-D array; got shape {array.shape}")
    return array


def sample_to_row(sample: Sample, fields: Sequence[str], token: Callable[[Any, str], Any] | None = None
                  ) -> dict[str, Any]:
    """The named fields of ``sample`` as a storage row (token fields through ``token``,
    by default copied: ``_token_copy``)."""
    token = token or _token_copy
    row: dict[str, Any] = {"uid": sample.uid, "group_id": sample.group_id}
    for name in fields:
        value = getattr(sample, name)
        row[name] = token(value, name) if name in TOKEN_FIELDS else value
    return row


def tags_of(row: dict[str, Any], mask: int) -> SampleTags:
    """The controller's tags for a row (lengths and versions of the fields it carries)."""
    versions = row.get("token_versions")
    prompt, response = row.get("prompt_ids"), row.get("response_ids")
    return SampleTags(
        uid=row["uid"],
        group_id=row["group_id"],
        mask=mask,
        min_version=-1 if versions is None else min_version_of(versions),
        max_version=-1 if versions is None else max_version_of(versions),
        num_prompt_tokens=-1 if prompt is None else len(prompt),
        num_response_tokens=-1 if response is None else len(response),
    )


def _handed_out(value: list | np.ndarray) -> list | np.ndarray:
    # The row may be redelivered: a list is copied, an array handed out as a read-only view.
    if isinstance(value, list):
        return list(value)
    view = value.view()
    view.flags.writeable = False
    return view


def row_to_sample(row: dict[str, Any]) -> Sample:
    """A ``Sample`` from an in-process row (its token fields as they were put, see
    ``_handed_out``); fields the row lacks keep the Sample defaults."""
    kwargs: dict[str, Any] = {"uid": row["uid"], "group_id": row["group_id"]}
    for name, value in row.items():
        if name in TOKEN_FIELDS:
            kwargs[name] = _handed_out(value)
        elif name in _BIT:
            kwargs[name] = value
    kwargs.setdefault("prompt_ids", [])
    return Sample(**kwargs)


# ------------------------------------------------------------------ msgpack rows
class _Identity(msgspec.Struct):
    """The two keys every row has; decoding into it skips the token fields unparsed."""

    uid: str
    group_id: str


def _enc_hook(value: Any) -> Any:
    # A token array of a row (``sample_to_row`` made it contiguous, little-endian, in
    # the field's dtype) travels as its bytes: msgpack ``bin``, one memcpy.
    if isinstance(value, np.ndarray):
        return memoryview(value)  # type: ignore[arg-type]  # numpy's stub: no buffer protocol
    raise TypeError(f"a sample field of type {type(value).__name__} cannot be stored")


# Token fields of a row decoded as they travelled: a msgpack array as a list, a ``bin`` as a
# memoryview into the buffer (no copy). ``Sample`` has the same fields, token ones list-typed.
_WIRE_TOKEN_TYPES = {name: (list[float] if dtype is np.float32 else list[int]) | memoryview
                     for name, dtype in TOKEN_FIELDS.items()}
_SAMPLE_FIELDS = msgspec.structs.fields(Sample)


def _wire_field(f: msgspec.structs.FieldInfo) -> tuple:
    kind = _WIRE_TOKEN_TYPES.get(f.name, f.type)
    if f.default_factory is not msgspec.NODEFAULT:
        return (f.name, kind, msgspec.field(default_factory=f.default_factory))
    if f.default is not msgspec.NODEFAULT:
        return (f.name, kind, f.default)
    return (f.name, kind)


_WireSample = msgspec.defstruct("_WireSample", [_wire_field(f) for f in _SAMPLE_FIELDS], kw_only=True)


def _token_value(name: str, value: Any) -> Any:
    """A token field as it decoded -> what ``Sample`` holds: a list as is, a ``bin`` as a
    read-only array of its little-endian values (a view of the buffer, no copy)."""
    if isinstance(value, (memoryview, bytes)):
        return np.frombuffer(value, _LE_DTYPES[name])
    return value


def _sample_from_wire(w: Any) -> Sample:
    kwargs = {f.name: getattr(w, f.name) for f in _SAMPLE_FIELDS}
    for name in TOKEN_FIELDS:
        kwargs[name] = _token_value(name, kwargs[name])
    return Sample(**kwargs)


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_raw_rows_decoder = msgspec.msgpack.Decoder(list[dict[str, msgspec.Raw]])
_raw_row_decoder = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
_samples_decoder = msgspec.msgpack.Decoder(list[Sample])
_wire_samples_decoder = msgspec.msgpack.Decoder(list[_WireSample])  # type: ignore[valid-type]  # made by defstruct
_rows_decoder = msgspec.msgpack.Decoder(list[dict[str, Any]])
_row_decoder = msgspec.msgpack.Decoder(dict[str, Any])
_identities_decoder = msgspec.msgpack.Decoder(list[_Identity])


def encode_rows(rows: Sequence[dict[str, Any] | msgspec.Raw]) -> bytes:
    """One msgpack buffer for rows (each a row's encoded bytes, or a dict whose
    values are Python objects or ``msgspec.Raw``)."""
    return _encoder.encode(rows)


def encode_new_samples(samples: Sequence[Sample]) -> tuple[bytes, list[SampleTags]]:
    """Whole samples as the msgpack *body* of a rows array (``frame_rows`` adds the header), and their tags.

    Bodies of several puts concatenate into one write (``frame_rows``).
    """
    body, _, tags = encode_new_rows(samples)
    return bytes(body), tags


def encode_new_rows(samples: Sequence[Sample]) -> tuple[bytearray, list[int], list[SampleTags]]:
    """Whole samples as msgpack rows back to back (no array header), the end offset of
    each row in that body, and their tags.

    A ``Sample`` encodes as the same map as its full row, so the common case (token
    fields are lists) skips ``sample_to_row``'s copies: encoding is the copy. A sample
    holding numpy arrays goes through ``sample_to_row`` (its arrays travel as ``bin``).
    The row ends let a storage unit keep each row as a slice without parsing it.
    """
    body = bytearray()
    ends: list[int] = []
    tags = []
    for s in samples:
        if type(s.prompt_ids) is list and type(s.response_ids) is list and type(s.rollout_logprobs) is list \
                and type(s.token_versions) is list:  # fmt: skip
            _encoder.encode_into(s, body, -1)
            versions = s.token_versions
            tags.append(SampleTags(
                uid=s.uid, group_id=s.group_id, mask=FULL_MASK,
                min_version=min_version_of(versions), max_version=max_version_of(versions),
                num_prompt_tokens=len(s.prompt_ids), num_response_tokens=len(s.response_ids),
            ))  # fmt: skip
        else:
            row = sample_to_row(s, ALL_FIELDS, _wire_token)
            _encoder.encode_into(row, body, -1)
            tags.append(tags_of(row, FULL_MASK))
        ends.append(len(body))
    return body, ends, tags


def _wire_token(value: Any, name: str) -> Any:
    """Token field ``name`` ready for the encoder: an array already contiguous, 1-D and of the
    field's little-endian dtype as it is (encoding copies its bytes), anything else copied
    into one (``_token_copy``)."""
    if isinstance(value, np.ndarray) and value.dtype == _LE_DTYPES[name] and value.ndim == 1 \
            and value.flags.c_contiguous:  # fmt: skip
        return value
    return _token_copy(value, name)


def decode_new_rows(body: bytes | bytearray | memoryview, ends: Sequence[int]) -> list[dict[str, Any]]:
    """``encode_new_rows``' rows back as in-process rows (the local deployment's): a token
    field that travelled as a msgpack array is that list, one that travelled as bytes a
    read-only array of them, in the field's dtype."""
    view, start, rows = memoryview(body), 0, []
    for end in ends:
        row = _row_decoder.decode(view[start:end])
        start = end
        for name in TOKEN_FIELDS:
            value = row.get(name)
            if isinstance(value, bytes):
                row[name] = np.frombuffer(value, _LE_DTYPES[name])
        rows.append(row)
    return rows


def frame_rows(num_rows: int, bodies: Sequence[bytes]) -> bytes:
    """One msgpack rows array from the bodies of ``encode_new_samples`` holding ``num_rows`` in all."""
    if num_rows <= 15:
        header = bytes([0x90 | num_rows])
    elif num_rows <= 0xFFFF:
        header = b"\xdc" + num_rows.to_bytes(2, "big")
    else:
        header = b"\xdd" + num_rows.to_bytes(4, "big")
    return b"".join((header, *bodies))


def decode_raw_row(row: msgspec.Raw) -> dict[str, msgspec.Raw]:
    """One row kept whole (a slice of a write) as field -> msgpack slice, like ``decode_raw_rows``."""
    return _raw_row_decoder.decode(row)


def decode_raw_rows(buf: bytes) -> list[dict[str, msgspec.Raw]]:
    """Rows whose field values stay msgpack (zero-copy slices of ``buf``): what a storage actor keeps.

    A slice keeps all of ``buf`` alive, so one write's buffer is freed with its last row.
    """
    return _raw_rows_decoder.decode(buf)


def decode_samples(buf: bytes, mask: int) -> list[Sample]:
    """The ``Sample`` of each row of ``buf``, which carries the fields of ``mask``; a token
    field is a list, or a read-only array if it was put as one.

    Rows with the prompt and list token fields decode straight into Sample structs
    (C speed, validated); a buffer where some field travelled as ``bin`` goes through
    ``_WireSample``, and rows without the prompt through dicts, the missing fields
    keeping their defaults.
    """
    if mask & _BIT["prompt_ids"]:
        try:
            return _samples_decoder.decode(buf)
        except msgspec.ValidationError:  # some token field is a bin (an array was put), or bad data
            return [_sample_from_wire(w) for w in _wire_samples_decoder.decode(buf)]
    return [
        Sample(**{"prompt_ids": [], **{k: _token_value(k, v) if k in TOKEN_FIELDS else v for k, v in row.items()}})
        for row in _rows_decoder.decode(buf)
    ]


_tags_decoder = msgspec.msgpack.Decoder(list[SampleTags])


def encode_tags(tags: Sequence[SampleTags]) -> bytes:
    return _encoder.encode(tags)


def decode_tags(buf: bytes) -> list[SampleTags]:
    return _tags_decoder.decode(buf)


_field_decoders: dict[str, msgspec.msgpack.Decoder] = {}


def decode_field(buf: bytes, name: str) -> list[np.ndarray]:
    """Token field ``name`` of each row of ``buf`` as a numpy array, the other fields skipped
    unparsed (no Sample, no Python object for their tokens). A field that travelled as
    ``bin`` is read in place (a read-only view of ``buf``); a list is converted."""
    dec = _field_decoders.get(name)
    if dec is None:
        row = msgspec.defstruct(f"_Only_{name}", [(name, _WIRE_TOKEN_TYPES[name], msgspec.field(default_factory=list))])
        dec = _field_decoders[name] = msgspec.msgpack.Decoder(list[row])  # type: ignore[valid-type]  # defstruct
    dtype, le = TOKEN_FIELDS[name], _LE_DTYPES[name]
    out = []
    for r in dec.decode(buf):
        value = getattr(r, name)
        out.append(np.frombuffer(value, le) if type(value) is memoryview else np.array(value, dtype))
    return out


def decode_identities(buf: bytes) -> list[tuple[str, str]]:
    """``(uid, group_id)`` of each row of ``buf``, without building the token lists."""
    return [(r.uid, r.group_id) for r in _identities_decoder.decode(buf)]
