"""The device fast path of a delta push, over a :class:`sync.device.SenderPlan`'s layout.

A planned delta is an ordinary delta on the wire: one ``sparse`` entry per
changed piece, ``bitmask`` index stream and ``raw`` values, with the same
checksums, so any receiver applies it. What is planned is how it is made and
applied: over the whole layout at once, a few kernels, no per-piece Python.

    sender (DeltaPacker: buffers allocated on the first delta, then reused)
      _foreach_copy_(sources -> cur)                        cast included
      scan  per block of BLOCK elements: compare cur with last (the plan's
            storage, the last version sent) -> mask bytes, changed count,
            block sums of cur, block sums of last at the changed elements
      a few small torch ops: per-piece counts, blob lengths, payload offsets
      pack  per block: its mask bytes and changed values into the piece's
            blob; last <- cur at the changed elements; the old values kept
            (for revert_update)
      words per 8 KiB of each blob: its payload checksum (sync.checksum's
            bytes_checksum), summed per piece
      one read of [pieces, 9] to the host
    receiver (DeltaReceiverPlan, a GPU with Triton; others take the generic path)
      count per block: changed elements in its mask bytes -> value ranks
      apply per block: the new values written at the changed elements, the
            old ones kept; sums of the receiver's old values and of (new - old)
            there; one read to the host: every piece's base checksum (the
            whole piece, not only where the delta writes), num_changed and
            target checksum compared; any mismatch puts the kept values back
            (one more pass) before the error is raised

A blob is ``ceil(count / 8)`` mask bytes then ``num_changed`` values; blobs of
changed pieces follow each other at 8-byte aligned offsets in one payload
storage, cut into buckets at piece boundaries.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from contracts.weights import Manifest, TensorEntry, WeightUpdate
from sync import checksum as cks
from sync.streams import bitmask_encode
from sync.device import BLOCK, SenderPlan, _PieceSums, _piece_first

if TYPE_CHECKING:
    from sync.piece import Piece

MASK_BYTES = BLOCK // 8
_CHUNK_WORDS = 1024  # 8-byte words of payload per program of the payload-sum kernel
_COUNT_PER = 8  # blocks per program of the receiver's count kernel
WARPS = {"scan": 4, "pack": 4, "words": 4, "count": 4, "apply": 4}


# ---------------------------------------------------------------- kernels


class _Kernel(Protocol):
    """A ``triton.jit`` kernel, launched as ``kernel[grid](*args, **constexprs)``."""

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]: ...


def _kernels() -> dict[str, _Kernel]:
    global _K
    if _K is None:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            _K = {}  # no Triton: none (falsy, as kernels_available says)
            return _K
        _K = {name: build(triton, tl) for name, build in (("scan", _scan_kernel), ("pack", _pack_kernel),
              ("words", _words_kernel), ("count", _count_kernel), ("apply", _apply_kernel))}
    return _K


def _words_kernel(triton: ModuleType, tl: Any) -> _Kernel:
    @triton.jit
    def words_kernel(words_ptr, bytes_ptr, chunk_ptr, piece_ptr, out_ptr, CHUNK: tl.constexpr):
        # sync.checksum.bytes_checksum of a chunk of a blob: its 8-byte words (little-endian, word
        # index + 1 as weight), and in the chunk holding it the blob's last n % 8 bytes one by one
        c = tl.program_id(0).to(tl.int64)
        p = tl.load(chunk_ptr + c * 2).to(tl.int64)
        i = tl.load(chunk_ptr + c * 2 + 1)
        blob = tl.load(piece_ptr + p * 4)
        n = tl.load(piece_ptr + p * 4 + 2).to(tl.int32)
        w = i * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(words_ptr + (blob >> 3) + w, mask=w < (n >> 3), other=0)
        s0 = tl.sum(x, axis=0)
        s1 = tl.sum(x * (w + 1).to(tl.int64), axis=0)
        tail = n >> 3
        t = tl.arange(0, 8)
        here = (tail >= i * CHUNK) & (tail < i * CHUNK + CHUNK) & (t < (n & 7))
        b = tl.load(bytes_ptr + blob + tail * 8 + t, mask=here, other=0).to(tl.int64)
        tl.store(out_ptr + c, s0 + tl.sum(b, axis=0))
        tl.store(out_ptr + tl.num_programs(0) + c, s1 + tl.sum(b * (tail + t + 1).to(tl.int64), axis=0))

    return words_kernel


def _scan_kernel(triton: ModuleType, tl: Any) -> _Kernel:
    @triton.jit
    def scan_kernel(cur_ptr, last_ptr, mask_ptr, stats_ptr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        x = tl.load(cur_ptr + pid * BLOCK + offs)
        y = tl.load(last_ptr + pid * BLOCK + offs)
        ch = (x != y).to(tl.int32)
        byte = tl.sum(tl.reshape(ch, (BLOCK // 8, 8)) << tl.arange(0, 8)[None, :], axis=1)
        tl.store(mask_ptr + pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8), byte.to(tl.uint8))
        xs = x.to(tl.int64)
        ys = tl.where(ch != 0, y.to(tl.int64), 0)
        out = stats_ptr + pid * 5
        tl.store(out, tl.sum(ch, axis=0).to(tl.int64))
        tl.store(out + 1, tl.sum(xs, axis=0))
        tl.store(out + 2, tl.sum(xs * offs, axis=0))
        tl.store(out + 3, tl.sum(ys, axis=0))
        tl.store(out + 4, tl.sum(ys * offs, axis=0))

    return scan_kernel


def _pack_kernel(triton: ModuleType, tl: Any) -> _Kernel:
    @triton.jit
    def pack_kernel(cur_ptr, last_ptr, mask_ptr, prefix_ptr, blk_ptr, piece_ptr, payload_ptr, old_ptr,
                    ITEM: tl.constexpr, BLOCK: tl.constexpr):
        # blob positions and lengths are int32 (a blob is < 2 GiB: DeltaPacker checks)
        pid = tl.program_id(0).to(tl.int64)
        p = tl.load(blk_ptr + pid * 2)
        j = tl.load(blk_ptr + pid * 2 + 1)
        row = piece_ptr + p.to(tl.int64) * 4
        out = payload_ptr + tl.load(row)
        mbytes = tl.load(row + 1).to(tl.int32)
        n = tl.load(row + 2)
        first = tl.load(row + 3)
        mo = tl.arange(0, BLOCK // 8)
        q = j * (BLOCK // 8) + mo
        mb = tl.load(mask_ptr + pid * (BLOCK // 8) + mo)
        tl.store(out + q, mb, mask=(q < mbytes) & (n > 0))
        offs = tl.arange(0, BLOCK)
        bits = tl.load(mask_ptr + pid * (BLOCK // 8) + (offs >> 3)).to(tl.int32)
        ch = (bits >> (offs & 7)) & 1
        rank = tl.cumsum(ch, axis=0) - ch
        changed = ch != 0
        before = tl.load(prefix_ptr + pid)
        x = tl.load(cur_ptr + pid * BLOCK + offs, mask=changed, other=0)
        y = tl.load(last_ptr + pid * BLOCK + offs, mask=changed, other=0)
        tl.store(old_ptr + before + rank, y, mask=changed)
        tl.store(last_ptr + pid * BLOCK + offs, x, mask=changed)
        qv = mbytes + ITEM * ((before - tl.load(prefix_ptr + first)).to(tl.int32) + rank)
        xi = x.to(tl.int32)
        for t in tl.static_range(ITEM):
            tl.store(out + qv + t, ((xi >> (8 * t)) & 0xFF).to(tl.uint8), mask=changed)

    return pack_kernel


def _count_kernel(triton: ModuleType, tl: Any) -> _Kernel:
    @triton.jit
    def count_kernel(payload_ptr, blk_ptr, piece_ptr, cnt_ptr, num_blocks, BLOCK: tl.constexpr,
                     PER: tl.constexpr):
        # changed elements of PER blocks per program: the mask is an eighth of the values, and one
        # block's worth of it is too little work for a program
        for r in tl.static_range(PER):
            b = tl.program_id(0).to(tl.int64) * PER + r
            live = b < num_blocks
            p = tl.load(blk_ptr + b * 4, mask=live, other=0)
            j = tl.load(blk_ptr + b * 4 + 1, mask=live, other=0).to(tl.int32)
            row = piece_ptr + p * 4
            mbytes = tl.load(row + 1).to(tl.int32)
            q = j * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
            mb = tl.load(payload_ptr + tl.load(row) + q, mask=(q < mbytes) & live, other=0).to(tl.int32)
            bits = (mb[:, None] >> tl.arange(0, 8)[None, :]) & 1
            tl.store(cnt_ptr + b, tl.sum(tl.sum(bits, axis=1), axis=0).to(tl.int64), mask=live)

    return count_kernel


def _apply_kernel(triton: ModuleType, tl: Any) -> _Kernel:
    @triton.jit
    def apply_kernel(payload_ptr, blk_ptr, piece_ptr, prefix_ptr, sums_ptr, undo_ptr, undo_cap, like_ptr,
                     ITEM: tl.constexpr, BLOCK: tl.constexpr, UNDO: tl.constexpr):
        # write the new values where the mask says, keeping the old ones in undo (in order), and sum
        # the old values and (new - old) for the host's check; UNDO: put the kept values back
        pid = tl.program_id(0).to(tl.int64)
        p = tl.load(blk_ptr + pid * 4)
        j = tl.load(blk_ptr + pid * 4 + 1).to(tl.int32)
        dst = tl.load(blk_ptr + pid * 4 + 2).to(like_ptr.dtype)
        valid_n = tl.load(blk_ptr + pid * 4 + 3).to(tl.int32)
        row = piece_ptr + p * 4
        blob = payload_ptr + tl.load(row)
        mbytes = tl.load(row + 1).to(tl.int32)
        first = tl.load(row + 2)
        n = tl.load(row + 3).to(tl.int32)
        offs = tl.arange(0, BLOCK)
        valid = (offs < valid_n) & (n > 0)  # n == 0: a piece this delta leaves out
        bits = tl.load(blob + j * (BLOCK // 8) + (offs >> 3), mask=valid, other=0).to(tl.int32)
        ch = ((bits >> (offs & 7)) & 1) * valid.to(tl.int32)
        rank = tl.cumsum(ch, axis=0) - ch
        before = tl.load(prefix_ptr + pid)
        slot = before + rank
        changed = (ch != 0) & (slot < undo_cap)  # a corrupt mask cannot write what could not be undone
        if UNDO:
            tl.store(dst + offs, tl.load(undo_ptr + slot, mask=changed), mask=changed)
        else:
            qv = mbytes + ITEM * ((before - tl.load(prefix_ptr + first)).to(tl.int32) + rank)
            new = tl.zeros((BLOCK,), dtype=tl.int32)
            for t in tl.static_range(ITEM):  # nor read outside the blob
                inside = changed & (qv + t < n)
                new |= tl.load(blob + qv + t, mask=inside, other=0).to(tl.int32) << (8 * t)
            if ITEM == 2:
                new = (new << 16) >> 16  # sign-extend the 16-bit value
            old = tl.load(dst + offs, mask=valid, other=0)
            tl.store(undo_ptr + slot, old, mask=changed)
            tl.store(dst + offs, new.to(like_ptr.dtype.element_ty), mask=changed)
            old = old.to(tl.int64)
            d = tl.where(changed, new.to(tl.int64) - old, 0)
            out = sums_ptr + pid * 4
            tl.store(out, tl.sum(old, axis=0))
            tl.store(out + 1, tl.sum(old * offs, axis=0))
            tl.store(out + 2, tl.sum(d, axis=0))
            tl.store(out + 3, tl.sum(d * offs, axis=0))

    return apply_kernel


_K: dict[str, _Kernel] | None = None


def kernels_available() -> bool:
    """Whether the Triton kernels build here (Triton installed); the device is
    :func:`sync.codec.choose`'s to judge."""
    return bool(_kernels())


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.numel() + 1, dtype=torch.int64, device=x.device)
    torch.cumsum(x, 0, out=out[1:])
    return out


def _mb(count: int) -> int:
    return -(-count // 8)


# ---------------------------------------------------------------- sender


class DeltaPacker:
    """The buffers and tables of a planned delta for one :class:`SenderPlan`
    (``values``: its storage read as integers, which holds the last version
    sent, updated here at the changed elements)."""

    def __init__(self, plan: SenderPlan) -> None:
        storage, entries = plan.storage, plan.entries
        self.itemsize = plan.dst[0].element_size()
        self.cur_storage = torch.zeros_like(storage)
        self.cur_dst = [self.cur_storage[d.data_ptr() - storage.data_ptr():][: d.numel() * self.itemsize].view(d.dtype)
                        for d in plan.dst]
        self.cur = self.cur_storage.view(plan.values.dtype)
        self.last = plan.values
        num_blocks = self.last.numel() // BLOCK
        block_bytes = BLOCK * self.itemsize
        self.first_blocks = [(d.data_ptr() - storage.data_ptr()) // block_bytes for d in plan.dst]
        self.num_blocks = [-(-e.count // BLOCK) for e in entries]
        self.counts = [e.count for e in entries]
        dev = storage.device
        piece = torch.full((num_blocks,), len(entries), dtype=torch.int32)  # blocks of no piece: a last, empty row
        in_piece = torch.zeros(num_blocks, dtype=torch.int32)
        for i, (b0, nb) in enumerate(zip(self.first_blocks, self.num_blocks)):
            piece[b0 : b0 + nb] = i
            in_piece[b0 : b0 + nb] = torch.arange(nb, dtype=torch.int32)
        self.blocks = torch.stack((piece, in_piece), 1).contiguous().to(dev)
        self.mbytes = torch.tensor([_mb(c) for c in self.counts], dtype=torch.int64, device=dev)
        self.starts = torch.tensor(self.first_blocks, dtype=torch.int64, device=dev)
        self.ends = self.starts + torch.tensor(self.num_blocks, dtype=torch.int64, device=dev)
        self.sums = _PieceSums(self.first_blocks, self.num_blocks, [_piece_first(e.shard, e.start) for e in entries],
                               num_blocks, dev)
        # the payload-sum kernel's work: each piece's longest blob, in chunks
        num_chunks = torch.tensor([-(-(_mb(c) + self.itemsize * c) // (8 * _CHUNK_WORDS)) for c in self.counts])
        chunk_piece = torch.repeat_interleave(torch.arange(len(entries)), num_chunks)
        ends = torch.cumsum(num_chunks, 0)
        self.chunks = torch.stack((chunk_piece, torch.arange(chunk_piece.numel()) - (ends - num_chunks)[chunk_piece]),
                                  1).to(device=dev, dtype=torch.int32)
        self.chunk_starts, self.chunk_ends = (ends - num_chunks).to(dev), ends.to(dev)
        self.mask = torch.zeros(num_blocks * MASK_BYTES, dtype=torch.uint8, device=dev)
        self.payload = torch.empty(sum(-(-(_mb(c) + self.itemsize * c) // 8) * 8 for c in self.counts) or 8,
                                   dtype=torch.uint8, device=dev)
        if max(_mb(c) + self.itemsize * c for c in self.counts) >= 1 << 31:
            raise ValueError("sync.bucket_bytes must stay below 1.7 GiB for a planned delta (blob offsets are int32)")
        self.old = torch.empty(self.last.numel(), dtype=self.last.dtype, device=dev)
        self.num_changed = 0  # of the last pack: self.old[:num_changed] are the values it replaced

    def pack(self, kernels: bool) -> list[list[int]]:
        """Compare cur with last, write the payload, move last to cur; per piece
        ``[changed, blob offset, blob length, new sums (2), old sums at the
        changed elements (2), payload sums (2)]`` (checksums not yet masked).
        ``kernels``: with the Triton kernels, else the torch reference."""
        if not kernels:
            return self._pack_torch()
        k = _kernels()
        nb = self.blocks.shape[0]
        stats = torch.empty(nb, 5, dtype=torch.int64, device=self.cur.device)
        k["scan"][(nb,)](self.cur, self.last, self.mask, stats, BLOCK=BLOCK, num_warps=WARPS["scan"])
        prefix = _exclusive_cumsum(stats[:, 0])
        changed = prefix[self.ends] - prefix[self.starts]
        length = torch.where(changed > 0, self.mbytes + self.itemsize * changed, 0)
        aligned = (length + 7) // 8 * 8
        offset = torch.cumsum(aligned, 0) - aligned
        table = torch.stack((offset, self.mbytes, length, self.starts), 1)
        table = torch.cat((table, table.new_zeros(1, 4)))  # the empty row
        k["pack"][(nb,)](self.cur, self.last, self.mask, prefix, self.blocks, table, self.payload, self.old,
                         ITEM=self.itemsize, BLOCK=BLOCK, num_warps=WARPS["pack"])
        nc = self.chunks.shape[0]
        chunk_sums = torch.empty(2, nc, dtype=torch.int64, device=self.cur.device)
        k["words"][(nc,)](self.payload.view(torch.int64), self.payload, self.chunks, table, chunk_sums,
                          CHUNK=_CHUNK_WORDS, num_warps=WARPS["words"])
        pre = [_exclusive_cumsum(row) for row in chunk_sums]  # 1-D scans: a [2, n] one runs on two blocks
        pay = torch.stack([r[self.chunk_ends] - r[self.chunk_starts] for r in pre], 1)
        out = torch.cat((changed[:, None], offset[:, None], length[:, None], self.sums.from_blocks(stats[:, 1:3]),
                         self.sums.from_blocks(stats[:, 3:5]), pay), 1)
        rows = out.tolist()  # the one wait on the device
        self.num_changed = sum(r[0] for r in rows)
        return rows

    def _pack_torch(self) -> list[list[int]]:
        """The same bytes and figures, piece by piece (CPU and tests)."""
        rows, at, old_at = [], 0, 0
        self.mask.zero_()
        for b0, count in zip(self.first_blocks, self.counts):
            lo = b0 * BLOCK
            cur, last = self.cur[lo : lo + count], self.last[lo : lo + count]
            idx = torch.nonzero(cur != last).view(-1)
            k = idx.numel()
            mask = bitmask_encode(idx, count)
            self.mask[b0 * MASK_BYTES : b0 * MASK_BYTES + mask.numel()] = mask
            new_sum = cks._weighted_torch(cur).tolist()
            old_vals = last[idx]
            old_sum = [int(old_vals.to(torch.int64).sum()), int((old_vals.to(torch.int64) * idx).sum())]
            self.old[old_at : old_at + k] = old_vals
            old_at += k
            if not k:
                rows.append([0, at, 0, *new_sum, 0, 0, 0, 0])
                continue
            blob = torch.cat((mask, cur[idx].contiguous().view(torch.uint8)))
            n = blob.numel()
            self.payload[at : at + n] = blob
            rows.append([k, at, n, *new_sum, *old_sum, *cks.bytes_checksum(blob)])
            last[idx] = cur[idx]
            at += -(-n // 8) * 8
        # piece sums as the kernel path gives them: positions shifted to the piece's first element
        for row, e_first in zip(rows, self.sums.firsts.tolist()):
            for a in (3, 5):
                row[a + 1] = row[a + 1] + e_first * row[a]
        self.num_changed = old_at
        return rows

    def restore_previous(self) -> None:
        """cur <- the version before the last pack (last with the replaced values back)."""
        bits = (self.mask.view(-1, 1) >> torch.arange(8, dtype=torch.uint8, device=self.mask.device)) & 1
        pos = torch.nonzero(bits.view(-1)).view(-1)
        self.cur.copy_(self.last)
        self.cur[pos] = self.old[: pos.numel()]


def delta_update(plan: SenderPlan, packer: DeltaPacker, rows: list[list[int]], version: int, base_version: int,
                 base_sums: list[cks.Checksum], bucket_bytes: int) -> tuple[WeightUpdate, dict[int, cks.Checksum]]:
    """The update the packed payload is, cut into buckets at piece boundaries;
    and the new checksum of every changed piece (by piece index)."""
    m64 = cks.MASK64
    itemsize = packer.itemsize
    entries: list[TensorEntry] = []
    new_sums: dict[int, cks.Checksum] = {}
    cuts: list[int] = []  # payload offset where each bucket starts
    offsets: list[int] = []
    end = 0
    for i, (k, off, n, a0, a1, o0, o1, p0, p1) in enumerate(rows):
        if not k:
            continue
        if not cuts or off + n - cuts[-1] > bucket_bytes and off > cuts[-1]:
            cuts.append(off)
        checksum = (a0 & m64, a1 & m64)
        new_sums[i] = checksum
        e = plan.entries[i]
        mb = _mb(e.count)
        entries.append(TensorEntry(
            name=e.name, dtype=e.dtype, shape=e.shape, shard=e.shard, start=e.start, count=e.count,
            encoding="sparse", index_codec="bitmask", value_codec="raw", num_changed=k, bucket=len(cuts) - 1,
            offset=off - cuts[-1], nbytes=n, parts=(mb, itemsize * k, 0), checksum=checksum,
            base_checksum=base_sums[i], changed_base_checksum=(o0 & m64, o1 & m64), payload_checksum=(p0 & m64, p1 & m64)))
        offsets.append(off)
        end = off + n
    bounds = cuts + [end]
    buckets = [packer.payload[a:b] for a, b in zip(bounds, bounds[1:])]
    manifest = Manifest(version=version, base_version=base_version, kind="delta", entries=entries,
                        bucket_sizes=[b.numel() for b in buckets], num_elements=plan.num_elements,
                        num_changed=packer.num_changed, layout=plan.layout)
    return WeightUpdate(manifest=manifest, buckets=buckets), new_sums


# ---------------------------------------------------------------- receiver


class DeltaReceiverPlan:
    """Where each piece's blocks live in the receiver's tensors, for the
    planned delta kernels. It covers every piece it has been built for: a
    delta leaves unchanged pieces out, so a later one may name any subset
    (a piece it does not know takes a new plan, built for both). Tensors are
    held by weak reference, as :class:`sync.device.ReceiverPlan` does.
    ``pieces``: the :class:`sync.piece.Piece` of every entry."""

    def __init__(self, weights: dict[str, torch.Tensor], entries: list[TensorEntry], pieces: list[Piece]) -> None:
        self.entries = entries
        self.index = {(e.name, e.shard, e.start, e.count): i for i, e in enumerate(entries)}
        tensors = [weights[e.name] for e in entries]
        self.names = [e.name for e in entries]
        self.refs = [weakref.ref(t) for t in tensors]
        self.ptrs = [t.data_ptr() for t in tensors]
        views = cast("list[torch.Tensor]", [p.region_view() for p in pieces])  # every one there: _delta_receiver
        itemsize = views[0].element_size()
        dev = views[0].device
        # the kernels' element type (the values as integers); not a view: the plan holds no receiver memory
        self.like = torch.zeros(1, dtype=cks.int_view(views[0][:0]).dtype, device=dev)
        counts = torch.tensor([e.count for e in entries], dtype=torch.int64)
        num_blocks = (counts + BLOCK - 1) // BLOCK
        piece = torch.repeat_interleave(torch.arange(len(entries)), num_blocks)
        first = torch.cumsum(num_blocks, 0) - num_blocks
        j = torch.arange(piece.numel()) - first[piece]
        addr = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64)[piece] + j * (BLOCK * itemsize)
        self.blocks = torch.stack((piece, j, addr, torch.clamp(counts[piece] - j * BLOCK, max=BLOCK)), 1).to(dev)
        self.first_blocks = first.tolist()
        self.mbytes = [_mb(e.count) for e in entries]
        self.sums = _PieceSums(self.first_blocks, num_blocks.tolist(),
                               [_piece_first(e.shard, e.start) for e in entries], piece.numel(), dev)
        self.starts, self.ends = self.sums.starts, self.sums.ends

    def find(self, weights: dict[str, torch.Tensor], keys: list[tuple]) -> list[int] | None:
        """The plan's piece index of each key; None when a key is not covered
        or the receiver's tensors are not the ones the plan was built for."""
        found = [self.index.get(k) for k in keys]
        if None in found:
            return None
        for name, ref, ptr in zip(self.names, self.refs, self.ptrs):
            t = weights.get(name)
            if t is None or t is not ref() or t.data_ptr() != ptr:
                return None
        return found  # type: ignore[return-value]

    def apply(self, manifest: Manifest, region: torch.Tensor, blob_offsets: list[int], found: list[int]) -> None:
        """Write the changed elements and check every piece; undone on any mismatch (all or nothing)."""
        from sync.errors import ChecksumError

        kernels = _kernels()
        entries = manifest.entries
        rows = [0, 0, 0, 0] * len(self.entries)  # pieces the delta leaves out: no blob (length 0)
        for i, o, e in zip(found, blob_offsets, entries):
            rows[4 * i : 4 * i + 4] = (o, self.mbytes[i], self.first_blocks[i], e.nbytes)
        for i, fb in enumerate(self.first_blocks):
            rows[4 * i + 2] = fb
        table = torch.tensor(rows, dtype=torch.int64).to(region.device, non_blocking=True)
        nb = self.blocks.shape[0]
        counts = torch.empty(nb, dtype=torch.int64, device=region.device)
        kernels["count"][(-(-nb // _COUNT_PER),)](region, self.blocks, table, counts, nb, BLOCK=BLOCK, PER=_COUNT_PER,
                                                   num_warps=WARPS["count"])
        prefix = _exclusive_cumsum(counts)
        sums = torch.empty(nb, 4, dtype=torch.int64, device=region.device)
        cap = sum(e.num_changed for e in entries)
        undo = torch.empty(max(cap, 1), dtype=self.like.dtype, device=region.device)
        args = (region, self.blocks, table, prefix, sums, undo, cap, self.like)
        itemsize = self.like.element_size()
        kernels["apply"][(nb,)](*args, ITEM=itemsize, BLOCK=BLOCK, UNDO=False, num_warps=WARPS["apply"])
        got = torch.cat(((prefix[self.ends] - prefix[self.starts])[:, None], self.sums.from_blocks(sums[:, 0:2]),
                         self.sums.from_blocks(sums[:, 2:4])), 1).tolist()  # the one wait
        m64 = cks.MASK64
        try:
            for i, e in zip(found, entries):
                # the whole piece's base, and base + (new - old) at the changed elements = the target: a
                # payload whose mask or values are off, or a receiver drifted anywhere in the piece, fails
                k, b0, b1, d0, d1 = got[i]
                where = f"{e.name}[{e.start}:{e.start + e.count}]"
                if (b0 & m64, b1 & m64) != tuple(e.base_checksum or ()):
                    raise ChecksumError(f"{where}: receiver values differ from the base version")
                if k != e.num_changed or ((b0 + d0) & m64, (b1 + d1) & m64) != tuple(e.checksum):
                    raise ChecksumError(f"{where}: delta does not produce the target checksum")
        except ChecksumError:
            kernels["apply"][(nb,)](*args, ITEM=itemsize, BLOCK=BLOCK, UNDO=True, num_warps=WARPS["apply"])
            raise
        finally:  # the sender may refill its payload once this returns
            torch.cuda.current_stream(region.device).synchronize()
