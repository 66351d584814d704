"""The trainer side of weight sync: :class:`WeightSender`.

The sender keeps its own copy of the last version it sent, in the engine's
dtype (that is what receivers hold, so the bit comparison is exact), and
per-piece checksums of it. ``encode`` turns the trainer's current weights
into a full or delta :class:`WeightUpdate`:

    trainer weights (fp32 master, any sharding)
      ├─ planned (sync.device: one GPU, a fixed layout, reused every sync)
      │    full : a few kernels copy, cast and sum every piece
      │    delta: sync.codec.encode_planned_delta, every piece at once
      └─ per piece of <= bucket_bytes, cast to the engine dtype
           ├─ full : raw bytes -> bucket; checksum; copy into last-sent
           └─ delta: sync.codec.encode_piece: compare bit patterns with
                     last-sent (updating it at the changed elements) -> sparse
                     streams or raw, the smaller -> checksum moved by the
                     changed elements only
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Literal

import msgspec
import torch

from contracts.weights import Manifest, ShardSpec, TensorEntry, WeightUpdate, dtype_name
from sync import checksum as cks
from sync import codec, device
from sync.auto import TRANSPORTS, Kind, mode_for
from sync.config import SyncConfig
from sync.buckets import BucketWriter

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor, ShardSpec | None]]

_DEFAULTS = SyncConfig()  # the one set of defaults: the config's


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
    ``full_every_k`` versions when set; 0 or None: never); ``auto`` becomes
    one of them at the first :meth:`encode`, by ``transport`` (the link the
    updates go over) and the device of the weights (:func:`sync.auto.mode_for`).
    ``bucket_bytes``: payload bucket size
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
        transport: str = "inproc",
        dedup_tied: bool = True,
        device_plan: Literal["auto", "always", "never"] = "auto",
    ) -> None:
        if mode not in ("full", "delta", "auto"):
            raise ValueError(f"WeightSender.mode must be 'full', 'delta' or 'auto', got {mode!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"WeightSender.transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        if bucket_bytes < 64:
            raise ValueError(f"WeightSender.bucket_bytes must be >= 64, got {bucket_bytes}")
        if full_every_k is not None and full_every_k < 0:
            raise ValueError(f"WeightSender.full_every_k must be >= 0 (0 or None: never), got {full_every_k}")
        self.mode = mode
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.full_every_k = full_every_k or None
        self.dtype = dtype
        self.version: int | None = None  # last version encoded; None before the first
        self.last_encode_ms = 0.0
        self._prev: dict[tuple[str, ShardSpec | None], torch.Tensor] = {}
        self._prev_sums: dict[tuple[str, ShardSpec | None, int], cks.Checksum] = {}
        self._force_full = False
        self._updates_since_full = 0
        self._last_kind: Kind | None = None
        self.dedup_tied = dedup_tied
        self._undo: tuple[int | None, list[tuple] | str] | None = None  # "planned": the packer holds it
        self._scratch = codec.Scratch()  # the CPU delta path's buffers, kept across syncs
        self.device_plan = device_plan
        self._plan: device.SenderPlan | None = None
        self._plan_given: list[tuple] = []  # (name, address, shape, dtype, shard) the plan was built for
        self._plan_holds_prev = False  # the plan's storage holds the last version, not self._prev

    @classmethod
    def from_config(cls, cfg: SyncConfig, dtype: torch.dtype | str, transport: str = "inproc") -> WeightSender:
        """The sender a ``sync`` section describes; ``dtype``: the engines'
        (``rollout.engine.dtype``), a ``torch.dtype`` or its name; ``transport``:
        the link its updates go over (``sync.link.choose_transport``)."""
        if isinstance(dtype, str):
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"WeightSender dtype {dtype!r} is not a torch dtype name")
        resolved: torch.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        return cls(mode=cfg.mode, bucket_bytes=cfg.bucket_bytes, full_every_k=cfg.full_every_k, dtype=resolved,
                   transport=transport)

    def force_full(self) -> None:
        """Make the next update full (a receiver refused a delta)."""
        self._force_full = True

    def next_kind(self) -> Kind:
        """The kind the next :meth:`encode` will produce."""
        if self.version is None or self._force_full or self.mode == "full":
            return "full"
        if self.full_every_k is not None and self._updates_since_full + 1 >= self.full_every_k:
            return "full"
        assert self.mode == "delta", f"mode {self.mode!r} is resolved at the first encode"
        return "delta"

    def encode(self, named_tensors: NamedTensors, version: int) -> WeightUpdate:
        """Encode the weights as ``version``: a delta against :attr:`version`
        or a full update. Accepts ``{hf_name: tensor}`` or an iterable of
        ``(hf_name, local_shard_tensor, ShardSpec | None)``."""
        t0 = time.perf_counter()
        given = list(_iter_named(named_tensors))
        if self.mode == "auto":
            self.mode = mode_for(self.transport, str(given[0][1].device) if given else "cpu")
        kind = self.next_kind()
        # a forced full may re-send the version a receiver refused as a delta
        if self.version is not None and (version < self.version or (version == self.version and kind != "full")):
            raise ValueError(f"version {version} must be greater than the last sent {self.version}")
        if self.device_plan != "never" and self._plan_fits(given):
            if kind == "full":
                return self._encode_planned(version, t0)
            prev_version = self.version
            return self._sent(self._encode_planned_delta(version), t0, (prev_version, "planned"))
        items = self._collect(given)
        if kind == "full" and self.device_plan != "never" and device.plan_items(items, self.device_plan == "always"):
            self._build_plan(given, items)
            return self._encode_planned(version, t0)
        update, undo = self._encode_pieces(items, kind, version)
        # a delta can be undone from the old values at its changed positions;
        # a full update could only be undone from a whole second copy, so not at all
        # re-sending the same version in full (after a refusal) leaves the
        # copy as it was, so the delta that produced that version can still be undone
        return self._sent(update, t0, undo)

    def _encode_pieces(self, items: list[tuple[str, torch.Tensor, ShardSpec | None, torch.dtype]], kind: Kind,
                       version: int) -> tuple[WeightUpdate, tuple | None]:
        """The per-piece path: every tensor in pieces of <= a bucket, each raw or
        a delta; the update, and the undo log of a delta (None: not revertible)."""
        self._fill_prev()
        out = _Pieces(self.bucket_bytes)
        num_elements, fresh_any = 0, False
        for name, tensor, shard, dtype in items:
            if shard is not None and tuple(tensor.shape) != shard.local_shape:
                raise ValueError(f"{name}: shard tensor shape {tuple(tensor.shape)} != ShardSpec {shard.local_shape}")
            src = tensor.detach().reshape(-1)
            prev = self._prev.get((name, shard))
            fresh = prev is None or prev.numel() != src.numel() or prev.dtype != dtype
            if prev is None or fresh:  # the receivers have no base of it: sent whole
                prev = self._prev[(name, shard)] = torch.empty(src.numel(), dtype=dtype, device=src.device)
            fresh_any |= fresh and src.numel() > 0
            num_elements += src.numel()
            shape = tuple(shard.full_shape) if shard else tuple(tensor.shape)
            piece_elems = max(1, self.bucket_bytes // dtype.itemsize)
            for start in range(0, src.numel(), piece_elems):
                common = dict(name=name, dtype=dtype_name(dtype), shape=shape, shard=shard, start=start,
                              count=min(piece_elems, src.numel() - start))
                self._encode_piece(out, common, src[start : start + piece_elems], prev, raw=kind == "full" or fresh)
        sums = cks.read_sums(cks.pieces_sums([p[2] for p in out.pending]))  # one wait on the device for them all
        for (i, sum_key, _), checksum in zip(out.pending, sums):
            out.entries[i] = msgspec.structs.replace(out.entries[i], checksum=checksum)
            self._prev_sums[sum_key] = checksum
        out.writer.flush()
        manifest = Manifest(version=version, base_version=self.version if kind == "delta" else None, kind=kind,
                            entries=out.entries, bucket_sizes=[b.numel() for b in out.writer.buckets],
                            num_elements=num_elements, num_changed=out.num_changed)
        undo = (self.version, out.undo) if kind == "delta" and not fresh_any else None
        return WeightUpdate(manifest=manifest, buckets=out.writer.buckets), undo

    def _encode_piece(self, out: _Pieces, common: dict, piece: torch.Tensor, prev: torch.Tensor, raw: bool) -> None:
        """One piece (still in the trainer's dtype) against its last-sent copy
        ``prev`` (the whole tensor's): its entry into ``out``, ``prev`` updated."""
        name, shard, start, count = common["name"], common["shard"], common["start"], common["count"]
        sum_key = (name, shard, start)
        if raw:
            dtype, itemsize = prev.dtype, prev.element_size()
            bucket, offset, view = out.writer.reserve(count * itemsize, piece.device)
            new = view.view(dtype)
            new.copy_(piece)  # cast straight into the payload
            if new.is_cuda:  # filled in after the loop, read back with the others: one wait on the device
                out.pending.append((len(out.entries), sum_key, (new, shard, start)))
                checksum = (0, 0)
            else:
                checksum = cks.piece_checksum(new, shard, start)
            out.entries.append(TensorEntry(**common, encoding="raw", num_changed=count, bucket=bucket, offset=offset,
                                           nbytes=count * itemsize, checksum=checksum))
            prev[start : start + count].copy_(new)
            out.num_changed += count
        else:
            found = codec.encode_piece(out.writer, common, prev[start : start + count], piece, shard,
                                       self._prev_sums[sum_key], write_old=True, scratch=self._scratch)
            if found is None:
                return
            entry, where, old_values = found
            out.entries.append(entry)
            out.undo.append(((name, shard), sum_key, where, old_values, self._prev_sums[sum_key], common))
            out.num_changed += entry.num_changed
            checksum = entry.checksum
        self._prev_sums[sum_key] = checksum

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
            assert self._plan is not None
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
        assert self._plan is not None
        update, checksums = self._plan.encode(version)
        self._plan_holds_prev = True
        for e, checksum in zip(update.manifest.entries, checksums):
            self._prev_sums[(e.name, e.shard, e.start)] = checksum
        return self._sent(update, t0, None)

    def _encode_planned_delta(self, version: int, restore: bool = False) -> WeightUpdate:
        """A delta against the last version sent, through the plan
        (:func:`sync.codec.encode_planned_delta`); ``restore``: to the version before it."""
        plan = self._plan
        assert plan is not None and self.version is not None
        if not self._plan_holds_prev:  # the generic path sent last: its copies hold that version
            plan.load_prev()
            self._plan_holds_prev = True
        keys = [(e.name, e.shard, e.start) for e in plan.entries]
        update, new_sums = codec.encode_planned_delta(plan, version, self.version, [self._prev_sums[k] for k in keys],
                                                      self.bucket_bytes, restore=restore)
        for i, checksum in new_sums.items():
            self._prev_sums[keys[i]] = checksum
        return update

    def revert_update(self) -> WeightUpdate | None:
        """Take back the last update: restore the last-sent copy to the
        previous version and return the delta (base = the last version,
        version = the previous one) that takes receivers back there too.
        None when the last update was full (it cannot be undone cheaply)."""
        if self._undo is None:
            return None
        prev_version, undo = self._undo
        if prev_version is None:
            return None
        if isinstance(undo, str):  # "planned": the packer still holds what that delta replaced
            update = self._encode_planned_delta(prev_version, restore=True)
            self.version, self._undo = prev_version, None
            return update
        self._fill_prev()
        writer = BucketWriter(self.bucket_bytes)
        entries: list[TensorEntry] = []
        num_changed = 0
        for key, sum_key, where, old_vals, old_sum, common in reversed(undo):
            start, count = sum_key[2], common["count"]
            current = self._prev[key][start : start + count]
            restored = current.clone()
            idx = codec.positions(where)
            restored[idx] = old_vals
            found = codec.encode_piece(writer, common, current, restored, key[1], self._prev_sums[sum_key],
                                       scratch=self._scratch)
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



class _Pieces:
    """What the per-piece path of one encode builds up."""

    def __init__(self, bucket_bytes: int) -> None:
        self.writer = BucketWriter(bucket_bytes)
        self.entries: list[TensorEntry] = []
        self.undo: list[tuple] = []  # per delta piece: what revert_update needs
        self.pending: list[tuple[int, tuple, tuple]] = []  # device pieces whose checksums are summed after the loop
        self.num_changed = 0
