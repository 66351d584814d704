"""The trainer side of weight sync: :class:`WeightSender`.

The sender keeps its own copy of the last version it sent, in the engine's
dtype (that is what receivers hold, so the bit comparison is exact), and
per-piece checksums of it. ``encode`` turns the trainer's current weights
into a full or delta :class:`WeightUpdate`:

    trainer weights (fp32 master, any sharding)
      └─ per piece of <= bucket_bytes: cast to engine dtype
           ├─ full : raw bytes -> bucket; checksum; copy into last-sent
           └─ delta: compare bit patterns with last-sent. CPU: one pass of the
                     fused kernel (sync/native.py) per part of a piece, a part per
                     core: fp32 -> bf16 cast in cache, 64-element vector compares,
                     every stream, the sums, and last-sent updated at the changed
                     elements; without a C compiler the numpy path (sync/codec_np.py)
                     -> sparse (index + value streams) or raw, whichever is smaller
                     -> checksum moved by the changed elements only
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Literal

import msgspec
import numpy as np
import torch

from sync import checksum as cks
from sync import device
from sync import device_delta
from sync import native
from sync.auto import AutoConfig, AutoPolicy, Kind
from sync.codec import NativeChanges, as_bytes, encode_sparse, encode_sparse_native
from sync.config import SyncConfig
from contracts.weights import Manifest, ShardSpec, TensorEntry, WeightUpdate, dtype_name

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor, ShardSpec | None]]

_ALIGN = 8  # raw pieces start 8-byte aligned so receivers view them in place
_DEFAULTS = SyncConfig()  # the one set of defaults: the config's


class _BucketWriter:
    """Packs entry blobs into uint8 buckets of at most ``bucket_bytes``
    (a piece is never larger than that), writing each blob in place once."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.buckets: list[torch.Tensor] = []
        self._cur: torch.Tensor | None = None
        self._used = 0

    def reserve(self, nbytes: int, device: torch.device) -> tuple[int, int, torch.Tensor]:
        """Room for ``nbytes``: (bucket index, offset, the uint8 view to fill)."""
        pad = (-self._used) % _ALIGN
        if self._cur is not None and self._used + pad + nbytes > self._cur.numel():
            self.flush()
            pad = 0
        if self._cur is None:
            self._cur = torch.empty(max(self.bucket_bytes, nbytes), dtype=torch.uint8, device=device)
        self._cur[self._used : self._used + pad].zero_()
        offset = self._used + pad
        self._used = offset + nbytes
        return len(self.buckets), offset, self._cur[offset : self._used]

    def add(self, blob: torch.Tensor) -> tuple[int, int]:
        bucket, offset, view = self.reserve(blob.numel(), blob.device)
        view.copy_(blob)
        return bucket, offset

    def flush(self) -> None:
        if self._cur is not None:
            used = self._cur[: self._used]
            # a mostly empty last bucket should not pin a whole bucket of memory
            self.buckets.append(used.clone() if self._used < self._cur.numel() // 2 else used)
        self._cur, self._used = None, 0


def _iter_named(named: NamedTensors) -> Iterable[tuple[str, torch.Tensor, ShardSpec | None]]:
    if isinstance(named, Mapping):
        for name, t in named.items():
            yield name, t, None
    else:
        for item in named:
            if len(item) == 2:
                yield item[0], item[1], None
            else:
                yield item


class WeightSender:
    """Encodes the trainer's weights as updates against the last version sent.

    Runs build it from their ``sync`` section with :meth:`from_config`; the
    keyword defaults here are that section's (:class:`sync.config.SyncConfig`).

    ``mode``: ``full`` always sends everything; ``delta`` sends changes
    (full for the first update, after :meth:`force_full`, and every
    ``full_every_k`` versions when set; 0 or None: never); ``auto`` picks per sync from costs
    reported through :meth:`observe`. ``bucket_bytes``: payload bucket size
    and the largest piece of a tensor handled at once. ``dtype``: the dtype
    the engines hold for floating tensors (the comparison and payload are in
    it; other tensors keep theirs). ``dedup_tied``: send a tensor that shares
    storage with one already sent (``lm_head.weight`` tied to the embedding)
    only once, under its first name, since receivers tie it the same way.
    ``device_plan``: full updates of GPU tensors take the fixed-layout fast
    path of :mod:`sync.device` (``auto``); ``always`` on any device (tests),
    ``never`` not at all.
    """

    def __init__(
        self,
        mode: Literal["full", "delta", "auto"] = _DEFAULTS.mode,
        bucket_bytes: int = _DEFAULTS.bucket_bytes,
        full_every_k: int | None = _DEFAULTS.full_every_k,
        dtype: torch.dtype = torch.bfloat16,
        auto: AutoConfig | None = None,
        dedup_tied: bool = True,
        device_plan: Literal["auto", "always", "never"] = "auto",
    ) -> None:
        if mode not in ("full", "delta", "auto"):
            raise ValueError(f"WeightSender.mode must be 'full', 'delta' or 'auto', got {mode!r}")
        if bucket_bytes < 64:
            raise ValueError(f"WeightSender.bucket_bytes must be >= 64, got {bucket_bytes}")
        if full_every_k is not None and full_every_k < 0:
            raise ValueError(f"WeightSender.full_every_k must be >= 0 (0 or None: never), got {full_every_k}")
        self.mode = mode
        self.bucket_bytes = bucket_bytes
        self.full_every_k = full_every_k or None
        self.dtype = dtype
        self.policy = AutoPolicy(auto)
        self.version: int | None = None  # last version encoded; None before the first
        self.last_encode_ms = 0.0
        self._prev: dict[tuple[str, ShardSpec | None], torch.Tensor] = {}
        self._prev_sums: dict[tuple[str, ShardSpec | None, int], cks.Checksum] = {}
        self._force_full = False
        self._updates_since_full = 0
        self._last_kind: Kind | None = None
        self.dedup_tied = dedup_tied
        self._undo: tuple[int | None, list[tuple] | str] | None = None  # "planned": the packer holds it
        self._unreported: tuple[Kind, float, int] | None = None
        self._scratch: torch.Tensor | None = None
        self._native_scratch = native.EncodeScratch()
        self.device_plan = device_plan
        self._plan: device.SenderPlan | None = None
        self._plan_given: list[tuple] = []  # (name, address, shape, dtype, shard) the plan was built for
        self._plan_holds_prev = False  # the plan's storage holds the last version, not self._prev

    @classmethod
    def from_config(cls, cfg: SyncConfig, dtype: torch.dtype | str) -> WeightSender:
        """The sender a ``sync`` section describes; ``dtype``: the engines'
        (``rollout.engine.dtype``), a ``torch.dtype`` or its name."""
        if isinstance(dtype, str):
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"WeightSender dtype {dtype!r} is not a torch dtype name")
            dtype = getattr(torch, dtype)
        return cls(mode=cfg.mode, bucket_bytes=cfg.bucket_bytes, full_every_k=cfg.full_every_k, dtype=dtype)

    def _cast_scratch(self, piece: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """A buffer the CPU delta path casts a trainer-dtype piece into, kept
        across syncs (one piece, <= a bucket): fresh memory every piece costs
        page faults comparable to the cast itself."""
        if piece.dtype == dtype or piece.is_cuda:
            return None
        if self._scratch is None or self._scratch.dtype != dtype or self._scratch.numel() < piece.numel():
            self._scratch = torch.empty(piece.numel(), dtype=dtype)
        return self._scratch

    def force_full(self) -> None:
        """Make the next update full (a receiver refused a delta)."""
        self._force_full = True

    def next_kind(self) -> Kind:
        """The kind the next :meth:`encode` will produce."""
        if self.version is None or self._force_full or self.mode == "full":
            return "full"
        if self.full_every_k is not None and self._updates_since_full + 1 >= self.full_every_k:
            return "full"
        return "delta" if self.mode == "delta" else self.policy.choose()

    def observe(self, kind: Kind, *, encode_ms: float, transfer_ms: float, apply_ms: float) -> None:
        """Report the measured cost of a sync of ``kind`` (feeds ``auto``)."""
        self._unreported = None
        self.policy.observe(kind, encode_ms + transfer_ms + apply_ms)

    def _estimate_unreported(self) -> None:
        # Nobody reported how the last sync went: estimate it from what we know.
        if self._unreported is not None:
            kind, encode_ms, nbytes = self._unreported
            self.policy.observe(kind, encode_ms + nbytes / self.policy.config.assumed_bytes_per_s * 1e3)
            self._unreported = None

    def encode(self, named_tensors: NamedTensors, version: int) -> WeightUpdate:
        """Encode the weights as ``version``: a delta against :attr:`version`
        or a full update. Accepts ``{hf_name: tensor}`` or an iterable of
        ``(hf_name, local_shard_tensor, ShardSpec | None)``."""
        t0 = time.perf_counter()
        self._estimate_unreported()
        kind = self.next_kind()
        # a forced full may re-send the version a receiver refused as a delta
        if self.version is not None and (version < self.version or (version == self.version and kind != "full")):
            raise ValueError(f"version {version} must be greater than the last sent {self.version}")
        given = list(_iter_named(named_tensors))
        if self.device_plan != "never" and self._plan_fits(given):
            if kind == "full":
                return self._encode_planned(version, t0)
            prev_version = self.version
            return self._sent(self._encode_planned_delta(version), t0, (prev_version, "planned"))
        planned = kind == "full" and self.device_plan != "never"
        items = self._collect(given)
        if planned and device.plan_items(items, self.device_plan == "always"):
            self._build_plan(given, items)
            return self._encode_planned(version, t0)
        self._fill_prev()
        writer = _BucketWriter(self.bucket_bytes)
        entries: list[TensorEntry] = []
        undo: list[tuple] = []  # per delta piece: what revert_update needs
        revertible = kind == "delta"
        num_elements = num_changed = 0
        pending: list[tuple[int, tuple, tuple]] = []  # device pieces whose checksums are summed after the loop
        for name, tensor, shard, dtype in items:
            piece_elems = max(1, self.bucket_bytes // dtype.itemsize)
            shape = tuple(shard.full_shape) if shard else tuple(tensor.shape)
            if shard is not None and tuple(tensor.shape) != shard.local_shape:
                raise ValueError(f"{name}: shard tensor shape {tuple(tensor.shape)} != ShardSpec {shard.local_shape}")
            src = tensor.detach().reshape(-1)
            key = (name, shard)
            prev = self._prev.get(key)
            fresh = prev is None or prev.numel() != src.numel() or prev.dtype != dtype
            if fresh:
                prev = self._prev[key] = torch.empty(src.numel(), dtype=dtype, device=src.device)
            num_elements += src.numel()
            itemsize = prev.element_size()
            for start in range(0, src.numel(), piece_elems):
                piece = src[start : start + piece_elems]  # still in the trainer's dtype
                count = piece.numel()
                common = dict(name=name, dtype=dtype_name(dtype), shape=shape, shard=shard, start=start, count=count)
                sum_key = (name, shard, start)
                if kind == "full" or fresh:
                    revertible = revertible and kind == "delta" and not fresh
                    bucket, offset, view = writer.reserve(count * itemsize, src.device)
                    new = view.view(dtype)
                    new.copy_(piece)  # cast straight into the payload
                    if new.is_cuda:  # filled in after the loop, read back with the others: one wait on the device
                        pending.append((len(entries), sum_key, (new, shard, start)))
                        checksum = (0, 0)
                    else:
                        checksum = cks.piece_checksum(new, shard, start)
                    entries.append(TensorEntry(**common, encoding="raw", num_changed=count, bucket=bucket,
                                               offset=offset, nbytes=count * itemsize, checksum=checksum))
                    prev[start : start + count].copy_(new)
                    num_changed += count
                else:
                    old = prev[start : start + count]
                    found = _delta_piece(writer, common, old, piece, shard, self._prev_sums[sum_key],
                                         write_old=True, scratch=self._cast_scratch(piece, dtype),
                                         native_scratch=self._native_scratch)
                    if found is None:
                        continue
                    entry, where, old_vals = found
                    entries.append(entry)
                    undo.append((key, sum_key, where, old_vals, self._prev_sums[sum_key], common))
                    num_changed += entry.num_changed
                    checksum = entry.checksum
                self._prev_sums[sum_key] = checksum
        for (i, sum_key, _), checksum in zip(pending, cks.read_sums(cks.pieces_sums([p[2] for p in pending]))):
            entries[i] = msgspec.structs.replace(entries[i], checksum=checksum)
            self._prev_sums[sum_key] = checksum
        writer.flush()
        manifest = Manifest(
            version=version,
            base_version=self.version if kind == "delta" else None,
            kind=kind,
            entries=entries,
            bucket_sizes=[b.numel() for b in writer.buckets],
            num_elements=num_elements,
            num_changed=num_changed,
        )
        # a delta can be undone from the old values at its changed positions;
        # a full update could only be undone from a whole second copy, so not at all
        # re-sending the same version in full (after a refusal) leaves the
        # copy as it was, so the delta that produced that version can still be undone
        return self._sent(WeightUpdate(manifest=manifest, buckets=writer.buckets), t0,
                          (self.version, undo) if revertible else None)

    def _sent(self, update: WeightUpdate, t0: float, undo: tuple | None) -> WeightUpdate:
        """Record ``update`` as the last version sent."""
        version, kind = update.manifest.version, update.manifest.kind
        if undo is not None:
            self._undo = undo
        elif version != self.version:
            self._undo = None
        self.version = version
        self._force_full = False
        self._updates_since_full = 0 if kind == "full" else self._updates_since_full + 1
        self._last_kind = kind
        self.last_encode_ms = update.manifest.encode_ms = (time.perf_counter() - t0) * 1e3
        self._unreported = (kind, self.last_encode_ms, update.manifest.payload_bytes)
        return update

    def _collect(self, given: list[tuple[str, torch.Tensor, ShardSpec | None]]
                 ) -> list[tuple[str, torch.Tensor, ShardSpec | None, torch.dtype]]:
        """(name, tensor, shard, engine dtype) to send: tied aliases once."""
        items, seen = [], set()
        for name, tensor, shard in given:
            if self.dedup_tied and tensor.numel():
                alias = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
                if alias in seen:
                    continue
                seen.add(alias)
            items.append((name, tensor, shard, self.dtype if tensor.is_floating_point() else tensor.dtype))
        return items

    def _fill_prev(self) -> None:
        """The last-sent copies, up to date (a planned full update leaves the
        last version in its storage until a delta needs them)."""
        if self._plan_holds_prev:
            self._plan.fill_prev()
            self._plan_holds_prev = False

    def _plan_fits(self, given: list[tuple[str, torch.Tensor, ShardSpec | None]]) -> bool:
        """The plan was built for these tensors: the same names over the same
        memory (trainers hand over fresh detached views every time, so not the
        same objects; the plan's own views keep that memory from being reused)."""
        plan_given = self._plan_given
        if self._plan is None or len(given) != len(plan_given):
            return False
        for (name, t, shard), (name0, ptr0, shape0, dtype0, shard0) in zip(given, plan_given):
            if t.data_ptr() != ptr0 or name != name0 or t.shape != shape0 or t.dtype != dtype0 or shard != shard0:
                return False
        return True

    def _build_plan(self, given: list, items: list) -> None:
        """Lay out a full update of ``items`` for the device fast path (:mod:`sync.device`)."""
        self._fill_prev()
        self._plan = None  # its storage goes before the new one is allocated
        planned = []
        for name, t, shard, dtype in items:
            if shard is not None and tuple(t.shape) != shard.local_shape:
                raise ValueError(f"{name}: shard tensor shape {tuple(t.shape)} != ShardSpec {shard.local_shape}")
            src = t.detach().reshape(-1)
            prev = self._prev.get((name, shard))
            if prev is None or prev.numel() != src.numel() or prev.dtype != dtype or prev.device != src.device:
                prev = self._prev[(name, shard)] = torch.empty(src.numel(), dtype=dtype, device=src.device)
            shape = tuple(shard.full_shape) if shard else tuple(t.shape)
            planned.append((name, src, shard, dtype, prev, shape))
        self._plan = device.SenderPlan(planned, self.bucket_bytes, items[0][1].device)
        self._plan_given = [(name, t.data_ptr(), t.shape, t.dtype, shard) for name, t, shard in given]

    def _encode_planned(self, version: int, t0: float) -> WeightUpdate:
        """A full update through the plan: a few kernels, no per-tensor Python."""
        update, checksums = self._plan.encode(version)
        self._plan_holds_prev = True
        for e, checksum in zip(update.manifest.entries, checksums):
            self._prev_sums[(e.name, e.shard, e.start)] = checksum
        return self._sent(update, t0, None)

    def _encode_planned_delta(self, version: int, restore: bool = False) -> WeightUpdate:
        """A delta against the last version sent, through the plan
        (:mod:`sync.device_delta`); ``restore``: to the version before it."""
        plan = self._plan
        if not self._plan_holds_prev:  # the generic path sent last: its copies hold that version
            plan.load_prev()
            self._plan_holds_prev = True
        if plan.delta is None:
            plan.delta = device_delta.DeltaPacker(plan)
        packer = plan.delta
        if restore:
            packer.restore_previous()
        else:
            torch._foreach_copy_(packer.cur_dst, plan.src)
        rows = packer.pack()
        keys = [(e.name, e.shard, e.start) for e in plan.entries]
        update, new_sums = device_delta.delta_update(plan, packer, rows, version, self.version,
                                                     [self._prev_sums[k] for k in keys], self.bucket_bytes)
        for i, checksum in new_sums.items():
            self._prev_sums[keys[i]] = checksum
        return update

    def revert_update(self) -> WeightUpdate | None:
        """Take back the last update: restore the last-sent copy to the
        previous version and return the delta (base = the last version,
        version = the previous one) that takes receivers back there too.
        None when the last update was full (it cannot be undone cheaply)."""
        if self._undo is None or self._undo[0] is None:
            return None
        prev_version, undo = self._undo
        if undo == "planned":  # the packer still holds what that delta replaced
            update = self._encode_planned_delta(prev_version, restore=True)
            self.version, self._undo = prev_version, None
            return update
        self._fill_prev()
        writer = _BucketWriter(self.bucket_bytes)
        entries: list[TensorEntry] = []
        num_changed = 0
        for key, sum_key, where, old_vals, old_sum, common in reversed(undo):
            start, count = sum_key[2], common["count"]
            current = self._prev[key][start : start + count]
            restored = current.clone()
            idx = _positions(where)
            restored[idx] = old_vals
            found = _delta_piece(writer, common, current, restored, key[1], self._prev_sums[sum_key],
                                 native_scratch=self._native_scratch)
            assert found is not None and found[0].checksum == old_sum, "undo log out of step with last-sent copy"
            entries.append(found[0])
            current[idx] = old_vals
            self._prev_sums[sum_key] = old_sum
            num_changed += idx.numel()
        writer.flush()
        manifest = Manifest(version=prev_version, base_version=self.version, kind="delta", entries=entries,
                            bucket_sizes=[b.numel() for b in writer.buckets],
                            num_elements=sum(t.numel() for t in self._prev.values()), num_changed=num_changed)
        self.version, self._undo = prev_version, None
        return WeightUpdate(manifest=manifest, buckets=writer.buckets)


def _native_ok(old: torch.Tensor, new: torch.Tensor) -> bool:
    return not old.is_cuda and not new.is_cuda and old.is_contiguous() and native.supports(old.element_size())


def _delta_piece(writer: _BucketWriter, common: dict, old: torch.Tensor, new: torch.Tensor,
                 shard: ShardSpec | None, base: cks.Checksum, *, write_old: bool = False,
                 scratch: torch.Tensor | None = None,
                 native_scratch: native.EncodeScratch | None = None) -> tuple[TensorEntry, tuple, torch.Tensor] | None:
    """Encode how piece ``old`` became ``new`` (any float dtype; compared in
    ``old``'s), sparse or raw, the smaller; return (entry, how to find the
    changed positions again, old values there), None if unchanged. The
    positions are ``("idx", int32 tensor)`` or ``("stream", codec, bytes, count,
    num_changed)`` for :func:`_positions`. ``write_old``: ``old`` becomes
    ``new`` as a side effect (changed elements only)."""
    start = common["start"]
    contiguous = shard is None or shard.is_contiguous
    found: NativeChanges | None = None
    if _native_ok(old, new):
        found = encode_sparse_native(old, new, write_old=write_old, scratch=native_scratch or native.EncodeScratch(),
                                     cast_buf=scratch)
        k = found.num_changed
        if k == 0:
            return None
        old_vals, plan, sums = found.old_values, found.plan, found.sums
        if contiguous:
            old_sum, new_sum = cks.shift_sums(sums[0], shard, start), cks.shift_sums(sums[1], shard, start)
        else:  # position weights need the shard's layout: decode the positions
            idx = torch.from_numpy(_stream_positions(found.index_codec, found.index_stream, common["count"], k))
            old_sum = cks.sparse_checksum(old_vals, idx, shard, start)
            new_sum = cks.sparse_checksum(_new_at(old, new, idx, write_old), idx, shard, start)
    else:
        idx, old_vals, new_vals, plan, sums = encode_sparse(old, new, write_old=write_old, scratch=scratch)
        k = idx.numel()
        if k == 0:
            return None
        if sums is not None and contiguous:  # summed while comparing
            old_sum, new_sum = cks.shift_sums(sums[0], shard, start), cks.shift_sums(sums[1], shard, start)
        else:
            old_sum, new_sum = cks.sparse_checksum(old_vals, idx, shard, start), cks.sparse_checksum(new_vals, idx, shard, start)
    checksum = cks.add(base, cks.sub(new_sum, old_sum))
    if plan is None:
        blob = as_bytes(new.to(old.dtype))
        extra: dict = dict(encoding="raw")
        bucket, offset = writer.add(blob)
    else:
        index_codec, value_codec, streams = plan
        chunks = [[s] if isinstance(s, torch.Tensor) else s for s in streams]
        parts = tuple(sum(c.numel() if isinstance(c, torch.Tensor) else c.size for c in s) for s in chunks)
        bucket, offset, blob = writer.reserve(sum(parts), old.device)
        dst = blob.numpy() if not blob.is_cuda else None
        if found is not None:  # the kernel's streams: copied and summed in one call
            payload_checksum = native.pack_bytes(dst, [c for s in chunks for c in s])
        else:
            at = 0
            for s in chunks:  # straight into the bucket, no concatenated copy
                for c in s:
                    num = c.numel() if isinstance(c, torch.Tensor) else c.size
                    if dst is not None:  # numpy copies: no torch worker threads woken per small stream
                        np.copyto(dst[at : at + num], c.numpy() if isinstance(c, torch.Tensor) else c)
                    else:
                        blob[at : at + num].copy_(c)
                    at += num
            payload_checksum = cks.bytes_checksum(blob)
        extra = dict(encoding="sparse", index_codec=index_codec, value_codec=value_codec,
                     parts=parts, payload_checksum=payload_checksum, changed_base_checksum=old_sum)
    entry = TensorEntry(**common, **extra, num_changed=k, bucket=bucket, offset=offset,
                        nbytes=blob.numel(), checksum=checksum, base_checksum=base)
    if found is not None:
        if plan is not None:  # the index stream is in the bucket already: point at it
            stream = blob[: parts[0]]
        else:
            stream = torch.from_numpy(np.concatenate(found.index_stream))
        where: tuple = ("stream", found.index_codec, stream, common["count"], k)
    else:
        where = ("idx", idx.to(torch.int32))  # int32: the undo log is O(changed) and should stay small
    return entry, where, old_vals


def _stream_positions(codec: str, stream: list | torch.Tensor, count: int, k: int) -> np.ndarray:
    buf = stream.numpy() if isinstance(stream, torch.Tensor) else np.concatenate(stream)
    return native.decode_index(buf, codec, count, k)


def _new_at(old: torch.Tensor, new: torch.Tensor, idx: torch.Tensor, written: bool) -> torch.Tensor:
    return old[idx] if written else new[idx].to(old.dtype)


def _positions(where: tuple) -> torch.Tensor:
    """The int64 changed positions an undo entry refers to."""
    if where[0] == "idx":
        return where[1].to(torch.int64)
    _, codec, stream, count, k = where
    return torch.from_numpy(_stream_positions(codec, stream, count, k))
