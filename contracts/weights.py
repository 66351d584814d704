"""The wire format of a weight update: a msgspec manifest plus payload buckets.

A :class:`WeightUpdate` moves one model version to receivers. Its
:class:`Manifest` lists *pieces*: element ranges of one tensor (in the
sender's shard-local flat order), each stored in one payload bucket at
``offset`` as either ``raw`` values or a ``sparse`` encoding
(index stream + value stream + escapes). Buckets are 1-D uint8 buffers of at
most ``bucket_bytes`` each, so neither side needs more than a couple of
buckets of extra memory per piece it handles.

Checksums are :mod:`sync.checksum` pairs over the piece's values *at the
target version*, weighted by their position in the full Hugging Face tensor,
so the checksum of a whole tensor is the sum of its pieces' checksums
whatever the trainer sharding was.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Protocol, TypeAlias, Union

import msgspec
import torch

if TYPE_CHECKING:
    import numpy as np

Checksum = tuple[int, int]


class BucketRef(Protocol):
    """A transport's lazy reference to a payload bucket (a key in this process's
    registry, a Ray object, a CUDA IPC handle): read with ``materialize()``."""

    def materialize(self) -> Bucket: ...


#: One payload bucket, as a sender made it or a receiver reads it: bytes, a numpy
#: or torch uint8 buffer (on any device), or a transport's reference to one.
Bucket: TypeAlias = Union[bytes, bytearray, memoryview, "np.ndarray", torch.Tensor, BucketRef]

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the manifest spelling)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; ``ValueError`` naming unknown dtypes."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


class ShardSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The slice of a full (HF-shaped) tensor one trainer rank holds:
    indices ``[offset, offset + length)`` along ``dim`` of ``full_shape``."""

    full_shape: tuple[int, ...]
    dim: int = 0
    offset: int = 0
    length: int

    def __post_init__(self) -> None:
        if not 0 <= self.dim < len(self.full_shape):
            raise ValueError(f"ShardSpec.dim={self.dim} out of range for shape {self.full_shape}")
        if self.offset < 0 or self.length < 0 or self.offset + self.length > self.full_shape[self.dim]:
            raise ValueError(
                f"ShardSpec slice [{self.offset}, {self.offset + self.length}) out of range "
                f"for dim {self.dim} of shape {self.full_shape}"
            )

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] = self.length
        return tuple(shape)

    @property
    def _inner(self) -> int:
        return math.prod(self.full_shape[self.dim + 1 :])

    @property
    def is_contiguous(self) -> bool:
        """True when the shard is one contiguous range of the flat full tensor."""
        return math.prod(self.full_shape[: self.dim]) == 1

    @property
    def global_start(self) -> int:
        """Flat position of the shard's first element (contiguous shards)."""
        return self.offset * self._inner

    def global_positions(self, local_flat: torch.Tensor) -> torch.Tensor:
        """Map shard-local flat indices (int64) to flat indices of the full tensor.
        Monotonic, so sorted local indices stay sorted."""
        inner = self._inner
        rest, r = torch.div(local_flat, inner, rounding_mode="floor"), local_flat % inner
        outer, m = torch.div(rest, self.length, rounding_mode="floor"), rest % self.length
        return (outer * self.full_shape[self.dim] + m + self.offset) * inner + r


class TensorEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One piece of one tensor in a payload bucket.

    ``start``/``count``: element range in the sender's shard-local flat order
    (the whole tensor when ``shard`` is None). ``encoding``: ``raw`` (``count``
    values of ``dtype``) or ``sparse`` (``parts`` = byte lengths of the index
    stream, the value stream and the escape values). ``checksum``: of the
    piece at the target version. ``base_checksum``: at the base version (delta
    pieces only; None otherwise). ``changed_base_checksum``: of the base values
    at the changed positions only (sparse pieces), so a receiver whose base
    differs exactly where the delta writes is caught in O(changed) time. ``payload_checksum``: of the sparse bytes
    (None for raw pieces, whose payload *is* the values ``checksum`` covers).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: ShardSpec | None = None
    start: int
    count: int
    encoding: Literal["raw", "sparse"]
    index_codec: Literal["varint", "bitmask"] | None = None
    value_codec: Literal["raw", "diff8"] | None = None
    num_changed: int
    bucket: int
    offset: int
    nbytes: int
    parts: tuple[int, ...] = ()
    checksum: Checksum
    base_checksum: Checksum | None = None
    changed_base_checksum: Checksum | None = None
    payload_checksum: Checksum | None = None


class Manifest(msgspec.Struct, kw_only=True):
    """What one update contains. ``base_version`` is None for ``full`` updates
    (they apply to any receiver). ``num_elements`` counts every element the
    sender holds, ``num_changed`` those that differ from the base version
    (all of them for a full update). ``layout``: a digest of the entries'
    placement (names, ranges, buckets, offsets; not the checksums) when the
    sender laid the payload out for the device fast path (``sync.device``):
    a receiver that has checked a layout once applies later updates of the
    same layout without per-piece work; empty otherwise. ``encode_ms``: the
    sender's own time to produce the update (for logs: a policy's measure of
    the encode also holds the call that fetched it); ``source_ms``: the source's
    whole call, weights gathered, encoded and published (0 where not timed)."""

    version: int
    base_version: int | None
    kind: Literal["full", "delta"]
    entries: list[TensorEntry]
    bucket_sizes: list[int]
    num_elements: int
    num_changed: int
    layout: str = ""
    encode_ms: float = 0.0
    source_ms: float = 0.0

    @property
    def payload_bytes(self) -> int:
        return sum(self.bucket_sizes)

    def __reduce__(self) -> tuple:
        """Pickled as msgpack: a 0.5B model's manifest (~300 entries) pickles and
        unpickles in a fraction of the time, on every push between processes."""
        return (_decode_manifest, (msgspec.msgpack.encode(self),))

    @property
    def changed_fraction(self) -> float:
        return self.num_changed / self.num_elements if self.num_elements else 0.0


class WeightUpdate(msgspec.Struct, kw_only=True):
    """A manifest plus its payload buckets (``bytes``, numpy uint8 arrays, or
    1-D uint8 torch tensors on any device, or a transport's references to them;
    one per ``manifest.bucket_sizes``)."""

    manifest: Manifest
    buckets: Sequence[Bucket]

    @property
    def nbytes(self) -> int:
        return self.manifest.payload_bytes

    def __reduce__(self) -> tuple:
        """Pickled for another process, device buckets travel as host arrays
        (the receiver's ``apply_update`` moves each piece to its weights'
        device). Runs never send an update this way: the trainer publishes it
        on a transport and only its manifest and bucket references travel
        (``sync.link``); transport references pickle as themselves."""
        return (_rebuild_update, (self.manifest, [_to_host(b) for b in self.buckets]))


def _decode_manifest(data: bytes) -> Manifest:
    return _MANIFEST_DECODER.decode(data)


_MANIFEST_DECODER = msgspec.msgpack.Decoder(Manifest)


def _to_host(bucket: Bucket) -> Bucket:
    if isinstance(bucket, torch.Tensor) and bucket.device.type != "cpu":
        return bucket.cpu().numpy()
    return bucket


def _rebuild_update(manifest: Manifest, buckets: Sequence[Bucket]) -> WeightUpdate:
    return WeightUpdate(manifest=manifest, buckets=buckets)


def merge_updates(updates: list[WeightUpdate]) -> WeightUpdate:
    """Combine the updates each trainer rank encoded for its own shards into
    one update (same version, base and kind) that receivers apply at once."""
    if not updates:
        raise ValueError("merge_updates needs at least one update")
    first = updates[0].manifest
    entries: list[TensorEntry] = []
    buckets: list[Bucket] = []
    sizes: list[int] = []
    for u in updates:
        m = u.manifest
        if (m.version, m.base_version, m.kind) != (first.version, first.base_version, first.kind):
            raise ValueError(
                f"cannot merge updates of different versions/kinds: "
                f"{(m.version, m.base_version, m.kind)} vs {(first.version, first.base_version, first.kind)}"
            )
        shift = len(buckets)
        entries.extend(msgspec.structs.replace(e, bucket=e.bucket + shift) for e in m.entries)
        buckets.extend(u.buckets)
        sizes.extend(m.bucket_sizes)
    manifest = Manifest(
        version=first.version,
        base_version=first.base_version,
        kind=first.kind,
        entries=entries,
        bucket_sizes=sizes,
        num_elements=sum(u.manifest.num_elements for u in updates),
        num_changed=sum(u.manifest.num_changed for u in updates),
    )
    return WeightUpdate(manifest=manifest, buckets=buckets)


def bucket_tensor(buf: Bucket) -> torch.Tensor:
    """View a payload bucket (bytes / bytearray / memoryview / numpy / torch,
    or a transport reference with ``materialize()``) as a 1-D uint8 tensor
    without copying. Read-only buffers are fine: the
    receiver only reads payloads, so torch's not-writable warning is moot."""
    import warnings

    if hasattr(buf, "materialize"):  # a transport's lazy reference (Ray object, CUDA IPC handle)
        buf = buf.materialize()
    if isinstance(buf, torch.Tensor):
        return buf.reshape(-1).view(torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if isinstance(buf, (bytes, bytearray, memoryview)):
            return torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
        import numpy as np

        return torch.from_numpy(np.asarray(buf).reshape(-1).view(np.uint8))


class BroadcastPush(msgspec.Struct, frozen=True):
    """The handle of one push over a collective transport (``broadcast``): it
    carries no payload; each receiver takes the update from its weight group,
    in step with the trainer's broadcast (``sync.link.EngineLink.receive``)."""

    version: int


#: What a push hands an engine's side to swap in: the update as its transport
#: published it (manifest plus bucket references), or a broadcast push.
WeightHandle: TypeAlias = WeightUpdate | BroadcastPush
