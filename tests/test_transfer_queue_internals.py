"""TransferQueue's parts below the client: the storage unit's encoded rows, the codec's
framing of new samples, the put coalescer and the controller's allocated indices."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest

from tests.helpers import make_samples
from transfer_queue import Sample, TransferQueueConfig
from transfer_queue.coalesce import PutCoalescer, ReserveRefused
from transfer_queue.codec import (
    ALL_FIELDS,
    FULL_MASK,
    decode_identities,
    decode_samples,
    encode_new_samples,
    encode_rows,
    fields_mask,
    frame_rows,
    sample_to_row,
    tags_of,
)
from transfer_queue.storage import StorageUnit

pytestmark = pytest.mark.timeout(30)


# ----------------------------------------------------------------- storage unit
def test_storage_unit_keeps_encoded_rows_unparsed_and_merges_field_writes() -> None:
    unit = StorageUnit(0)
    samples = make_samples(2, 2)
    prompts = [sample_to_row(s, ["prompt_ids"]) for s in samples]
    rest = [sample_to_row(s, [f for f in ALL_FIELDS if f != "prompt_ids"]) for s in samples]
    unit.put_encoded([0, 2, 4, 6], encode_rows(prompts))
    unit.put_encoded([0, 2, 4, 6], encode_rows(rest))  # a later write adds the other fields
    assert {type(v) for row in unit._rows.values() for v in row.values()} == {msgspec.Raw}
    assert decode_samples(unit.get_encoded([6, 0, 2, 4], None), FULL_MASK) == [samples[3], *samples[:3]]
    fields = ("response_ids", "reward")
    partial = decode_samples(unit.get_encoded([2], fields), fields_mask(fields))
    assert partial == [Sample(uid=samples[1].uid, group_id=samples[1].group_id, prompt_ids=[],
                              response_ids=samples[1].response_ids, reward=samples[1].reward)]  # fmt: skip
    assert decode_identities(unit.get_encoded([4, 0], fields)) == [(samples[2].uid, samples[2].group_id),
                                                                   (samples[0].uid, samples[0].group_id)]  # fmt: skip
    with pytest.raises(LookupError, match="no row"):
        unit.get_encoded([8], None)


# ------------------------------------------------------------------ put coalescer
@pytest.mark.asyncio
async def test_puts_issued_in_one_tick_share_one_write_and_keep_their_own_errors() -> None:
    writes: list[list[str]] = []
    release = asyncio.Event()

    async def write(key, rows, tags) -> None:
        writes.append(list(rows))
        if "bad" in rows:
            raise ReserveRefused(ValueError("bad row"))
        await release.wait()

    coalescer = PutCoalescer(write)
    first = [asyncio.create_task(coalescer.put("k", [f"a{i}"], [None])) for i in range(3)]
    await asyncio.sleep(0.01)
    assert writes == [["a0", "a1", "a2"]]  # one write for the three puts of that tick
    behind = [asyncio.create_task(coalescer.put("k", [r], [None])) for r in ("b", "bad")]
    release.set()
    await asyncio.gather(*first)
    assert await asyncio.gather(*behind, return_exceptions=True) == [None, ANY_VALUE_ERROR]
    # queued behind the first write, merged, refused together, then retried one by one
    assert writes[1:] == [["b", "bad"], ["b"], ["bad"]]


class _AnyValueError:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, ValueError) and str(other) == "bad row"


ANY_VALUE_ERROR = _AnyValueError()


# ------------------------------------------------------------------------ codec
def test_new_samples_encode_straight_into_bodies_that_frame_into_one_write() -> None:
    samples = make_samples(40, 2)  # 80 rows: a 3-byte array header once framed
    samples[5].response_ids = np.array(samples[5].response_ids)  # an engine's array takes the row path
    parts = [samples[:1], samples[1:17], samples[17:]]  # 1, 16 (a 3-byte header) and 63 rows
    encoded = [encode_new_samples(p) for p in parts]
    framed = frame_rows(len(samples), [body for body, _ in encoded])
    samples[5].response_ids = samples[5].response_ids.tolist()
    decoded = decode_samples(framed, FULL_MASK)
    assert decoded[5].response_ids.dtype == np.int32  # an array comes back as one (as int32)
    decoded[5].response_ids = decoded[5].response_ids.tolist()
    assert decoded == samples
    assert [t for _, tags in encoded for t in tags] == [tags_of(sample_to_row(s, ALL_FIELDS), FULL_MASK) for s in samples]
    assert decode_samples(frame_rows(0, []), FULL_MASK) == []


# ------------------------------------------------------------------- controller
@pytest.mark.asyncio
async def test_controller_places_new_samples_at_allocated_indices_that_never_collide() -> None:
    from transfer_queue.controller import Controller
    from transfer_queue.errors import QueueFull as Full

    controller = Controller(TransferQueueConfig(capacity=8, num_storage_units=2))
    first = controller.allocate(1, 4)
    rows = [sample_to_row(s, ALL_FIELDS) for s in make_samples(2, 2)]
    tags = [tags_of(r, FULL_MASK) for r in rows]
    mine = [(first + k) * 2 + 1 for k in range(4)]  # slots of unit 1: index % 2 == 1
    assert await controller.reserve("train", tags, True, indices=mine, commit=True) == mine
    assert controller.statistics().partitions["train"].ready == 4  # committed at once
    others = [sample_to_row(s, ALL_FIELDS) for s in make_samples(2, 2, prefix="o")]
    placed = await controller.reserve("train", [tags_of(r, FULL_MASK) for r in others], True)
    assert not set(placed) & set(mine)  # the round-robin path skips the allocated block
    with pytest.raises(Full):  # capacity still holds for placed puts
        late = [tags_of(sample_to_row(s, ALL_FIELDS), FULL_MASK) for s in make_samples(1, prefix="x")]
        await controller.reserve("train", late, True, wait=False, indices=[controller.allocate(0, 1) * 2], commit=True)
    with pytest.raises(ValueError, match="num_slots"):
        controller.allocate(0, 0)
