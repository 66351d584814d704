"""The Ray deployment: the controller and each storage unit are Ray actors.

    put         client ─put_new(indices, msgpack tags, msgpack rows)─► storage unit u
                        (stores the rows, then) ─reserve_new─► controller   one client call
    put_fields  client ─reserve─► controller;  client ─put_commit(rows)─► storage unit ─commit─► controller
    get         client ─get_batch─► controller (lease);  client ─get(indices)─► each storage unit: one buffer
    ack         client ─ack─► controller ─delete(indices), fire and forget─► storage units

Ray places, starts and kills the actors; the calls above go over direct sockets
(``rpc.py``: a Ray actor call costs tens of times the CPU of a socket message at
each end). Sample data never passes through the
controller: the client encodes the rows of each write as one msgpack buffer
(``codec.py``: token lists as msgpack arrays, token arrays as their bytes), the
storage unit keeps each new row whole as an unparsed slice of it (the client
sends the row lengths; a row is split into field slices only when fields are
added to it or a read asks for some fields) and answers a read with one buffer,
which the consumer decodes when it reads ``batch.samples`` (or one field of
each, ``batch.column``). Buffers travel out of band: never pickled per token.

A put of new samples is one call from the client: the client takes global
indices from a block the controller allocated to it (``Controller.allocate``)
and sends rows and tags to a storage unit, which stores the rows and then has
the controller register and commit them (the controller alone still decides
capacity, duplicate uids, closed and dead groups). The unit answers once the
controller did, so a put that returns is readable, and a put that raises
registered nothing (its rows are deleted). The controller learns of a row only
after its unit holds it, so a read or a delete never overtakes a row. The client
(a TransferQueue holding actor handles and addresses) pickles, so rollout and
trainer actors in other processes share one queue; each process opens its own
connections.

A unit that dies (its node lost) takes its rows with it:

    client call finds it gone, Ray confirms the actor dead
      ─► ControllerActor.unit_lost: its samples dropped ("storage_lost"), a replacement
         started with the unit's own Ray options (its placement-group bundle, placed
         again by Ray on the nodes left), given up after ``replace_timeout_s``
      ─► that call raises ``StorageUnitLost`` (a put goes on to the next live unit)
    clients learn the replacement lazily: the one whose call fails reports and gets
    every unit's state (``UnitState``); puts ask again at most every ``_RECHECK_S``
    while a unit is down, and wait for a replacement when every unit is down.

A replacement takes new samples only (slots above the lost ones); with none
coming the queue goes on with the units left, and with none left a put raises
``StorageUnitLost`` naming why each is gone.

Ray is imported only when this deployment is chosen, and must already be
initialized: the queue joins the running Ray, it never starts (or stops) one.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Sequence
from typing import Any

import ray

from transfer_queue.coalesce import ReserveRefused
from transfer_queue.codec import encode_rows, encode_tags, fields_mask
from transfer_queue.config import RpcLimits, TransferQueueConfig
from transfer_queue.deploy_local import _shard
from transfer_queue.errors import StorageUnitLost
from transfer_queue.ray_actors import REPLACE_TIMEOUT_S, Address, ControllerActor, StorageActor, UnitState, unwrap
from transfer_queue.rows import EncodedRows
from transfer_queue.rpc import PeerLost, RpcClient, oob
from transfer_queue.wire import QueueStats, SampleTags

__all__ = ["RayDeployment", "UnitState"]

# How long a client waits for Ray to say whether a storage unit it cannot reach is alive.
_ALIVE_CHECK_S = 30.0
# How often a client's puts ask whether a storage unit found dead was replaced.
_RECHECK_S = 1.0
# Slots a client takes from the controller at a time (per storage unit), for its puts.
_BLOCK_SLOTS = 1 << 16


class RayDeployment:
    """Client side of the Ray deployment: actor handles and addresses only, so it pickles."""

    encoded_put = True  # new samples travel as msgpack bodies (put_new), coalesced

    def __init__(self, controller: Any, units: list[Any], owner: bool, addresses: list[Address], secret: bytes,
                 limits: RpcLimits | None = None, generations: list[int] | None = None) -> None:
        self._controller, self.units, self._owner = controller, list(units), owner
        self._addresses, self._secret, self._limits = list(addresses), secret, RpcLimits(**(limits or {}))
        self._rpc = RpcClient(addresses[0], secret, "the TransferQueue controller", **self._limits)
        self._unit_rpc = [RpcClient(a, secret, f"TransferQueue storage unit {i}", **self._limits)
                          for i, a in enumerate(addresses[1:])]
        self._next_unit = 0
        # What this client knows of each unit's actor (``UnitState``, from the controller when a call failed)
        self._generations = list(generations or [0] * len(self.units))
        self._first_slots = [0] * len(self.units)
        self._down: set[int] = set()  # units with no actor now (found dead; a replacement may be starting)
        self._gone: dict[int, str] = {}  # ... and of those, the ones no replacement is coming for: why
        self._recheck_at = 0.0  # monotonic time a put next asks whether a down unit was replaced
        self._blocks: dict[int, tuple[int, int]] = {}  # unit -> [next, end) of this client's slots

    @classmethod
    async def create(cls, cfg: TransferQueueConfig, unit_options: Sequence[dict[str, object] | None] = (),
                     controller_options: dict[str, object] | None = None,
                     replace_timeout_s: float = REPLACE_TIMEOUT_S) -> RayDeployment:
        """Start the actors. ``unit_options`` (one per storage unit) and ``controller_options``:
        Ray actor options that place them (resources, a placement-group bundle, a node),
        instead of ``cfg.ray_num_cpus`` wherever Ray likes. A unit that dies is replaced with
        its options; ``replace_timeout_s``: how long its replacement may wait to be placed
        (its bundle placed again on the nodes left) before it is given up."""
        if not ray.is_initialized():
            raise RuntimeError("deployment='ray' joins a running Ray; call ray.init(...) first")
        secret = secrets.token_bytes(32)
        default: dict[str, object] = {"num_cpus": cfg.ray_num_cpus}
        options = [o or default for o in [*unit_options, *[None] * (cfg.num_storage_units - len(unit_options))]]
        # No runtime_env: Ray makes each actor's loop with uvloop already (the loop module says
        # where), and a per-actor runtime_env would cost each one a fresh worker process.
        units = [StorageActor.options(**options[i]).remote(i, secret, cfg.rpc_limits)  # type: ignore[attr-defined]
                 for i in range(cfg.num_storage_units)]
        controller_options = {**default, **(controller_options or {})}
        controller = ControllerActor.options(**controller_options).remote(cfg, secret)  # type: ignore[attr-defined]
        unit_addresses = await unwrap(asyncio.gather(*(u.serve.remote(cfg.ports) for u in units)))
        address = await unwrap(controller.setup.remote(unit_addresses, units, options, replace_timeout_s))
        await unwrap(asyncio.gather(*(u.connect.remote(address) for u in units)))
        return cls(controller, units, True, [address, *unit_addresses], secret, cfg.rpc_limits)

    def __reduce__(self) -> tuple:  # copies never kill the actors
        return (RayDeployment, (self._controller, self.units, False, self._addresses, self._secret, self._limits,
                                self._generations))

    async def call(self, method: str, *args: Any) -> Any:
        return await self._rpc.call("call", method, *args)

    async def put_new(
        self, partition: str, bodies: list[tuple[bytearray, list[int]]], tags: list[SampleTags], wait: bool,
        timeout_s: float | None
    ) -> list[int]:
        """A put of new samples: one call to the next storage unit (round robin), which
        stores the rows and has the controller register and commit them, at indices
        from this client's own block. ``bodies``: (rows, row ends) from ``codec.encode_new_rows``.

        Returns once they are committed (readable). ``ReserveRefused`` if the
        controller refused (nothing registered, the rows deleted). A unit found dead
        is reported (``_unit_call``) and the put goes to the next live one (or waits
        for a replacement); with none left and none coming it raises ``StorageUnitLost``.
        """
        lengths = []
        for _, ends in bodies:
            lengths += [end - start for start, end in zip([0, *ends], ends)]
        buf = bodies[0][0] if len(bodies) == 1 else b"".join(body for body, _ in bodies)
        while True:
            unit = await self._next_live_unit()
            indices = await self._take_indices(unit, len(tags))
            try:
                return await self._unit_call(
                    unit, "put_new", partition, encode_tags(tags), indices, lengths, wait, timeout_s, oob(buf)
                )
            except StorageUnitLost:
                pass  # reported; the next live unit
            except ReserveRefused as e:
                if not isinstance(e.cause, StorageUnitLost):
                    raise
                self._blocks.pop(unit, None)  # a block of the unit's lost actor: a new one, from its replacement
                await self._refresh()

    async def _next_live_unit(self) -> int:
        """The next unit with an actor (round robin). While one is down and a replacement
        may come, asks the controller (every ``_RECHECK_S``; at once, waiting, when none is up)."""
        if self._down.difference(self._gone):
            if len(self._down) == len(self.units):
                await self._refresh(wait=True)
            elif time.monotonic() >= self._recheck_at:
                await self._refresh()
        for _ in range(len(self.units)):
            unit = self._next_unit
            self._next_unit = (unit + 1) % len(self.units)
            if unit not in self._down:
                return unit
        raise StorageUnitLost(-1, f"every storage unit of this TransferQueue is gone: {'; '.join(self._gone.values())}")

    async def _refresh(self, wait: bool = False) -> None:
        self._adopt(await unwrap(self._controller.unit_states.remote(wait)))

    def _adopt(self, states: list[UnitState]) -> None:
        """Route by the controller's ``states``: a replaced unit's new actor (this client's
        block of the old one is dropped: its slots are lost), which units are down."""
        for unit, s in enumerate(states):
            if s.generation != self._generations[unit]:
                self._unit_rpc[unit].close()
                self._unit_rpc[unit] = RpcClient(s.address, self._secret, f"TransferQueue storage unit {unit}",
                                                 **self._limits)
                self.units[unit], self._addresses[unit + 1] = s.actor, s.address
                self._generations[unit] = s.generation
                self._blocks.pop(unit, None)
            self._first_slots[unit] = s.first_slot
            if s.live:
                self._down.discard(unit)
            else:
                self._down.add(unit)
            if s.gone is not None:
                self._gone[unit] = s.gone
        self._recheck_at = time.monotonic() + _RECHECK_S

    async def _unit_call(self, unit: int, method: str, *args: Any) -> Any:
        """``method`` on storage unit ``unit``. If the unit's actor is gone, it is reported: the
        controller drops the samples it held (``"storage_lost"``) and replaces it, and this
        raises ``StorageUnitLost``; a unit whose connection broke while Ray still has it alive
        keeps its samples (``PeerLost`` is raised)."""
        # the actor this call goes to: another call may learn of its replacement meanwhile
        rpc, actor, generation = self._unit_rpc[unit], self.units[unit], self._generations[unit]
        try:
            return await rpc.call(method, *args)
        except PeerLost as e:
            if not await self._actor_dead(actor):
                raise  # the actor lives: a broken connection, not lost rows (the next call reconnects)
            dropped, states = await unwrap(self._controller.unit_lost.remote(unit, generation))
            self._adopt(states)
            raise StorageUnitLost(
                unit, f"TransferQueue storage unit {unit} is gone ({e}); {dropped} pending samples it held were "
                "dropped as 'storage_lost', leased ones are dropped when their lease comes back; "
                + (states[unit].gone or "a replacement takes its new samples")
            ) from None

    async def _call_current(self, unit: int, indices: Sequence[int], method: str, *args: Any) -> Any:
        """``_unit_call`` about rows at ``indices``, again on the unit's new actor when this
        client knew only its lost one and the rows are the new one's (put there since)."""
        generation = self._generations[unit]
        try:
            return await self._unit_call(unit, method, *args)
        except StorageUnitLost:
            n = len(self.units)
            if (self._generations[unit] == generation or unit in self._down
                    or min(indices) // n < self._first_slots[unit]):
                raise
        return await self._unit_call(unit, method, *args)

    @staticmethod
    async def _actor_dead(actor: Any) -> bool:
        """Whether Ray says a storage unit's ``actor`` is dead (so its rows are gone)."""
        try:
            await asyncio.wait_for(actor.num_rows.remote(), _ALIVE_CHECK_S)
        except ray.exceptions.RayActorError:
            return True
        except asyncio.TimeoutError:
            pass  # no answer either way: not known to be dead
        return False

    async def _take_indices(self, unit: int, n: int) -> list[int]:
        """``n`` global indices on ``unit`` from this client's block (a new block when it runs out)."""
        start, end = self._blocks.get(unit, (0, 0))
        if end - start < n:
            size = max(n, _BLOCK_SLOTS)
            start = await self.call("allocate", unit, size)
            end = start + size
        self._blocks[unit] = (start + n, end)
        num_units = len(self.units)
        return [slot * num_units + unit for slot in range(start, start + n)]

    async def write_commit(
        self, indices: Sequence[int], rows: Sequence[dict[str, object]], all_indices: list[int], tags: list[SampleTags]
    ) -> None:
        shards = _shard(indices, rows, len(self.units))
        if len(shards) == 1:  # the usual case: a put's new samples share one unit
            ((u, (idx, part)),) = shards.items()
            await self._call_current(u, idx, "put_commit", idx, all_indices, tags, oob(encode_rows(part)))
            return
        await asyncio.gather(*(self._call_current(u, idx, "put", idx, oob(encode_rows(part)))
                               for u, (idx, part) in shards.items()))
        await self.call("commit", all_indices, tags)

    async def read(self, indices: Sequence[int], fields: Sequence[str] | None) -> EncodedRows:
        shards = _shard(range(len(indices)), indices, len(self.units), key=indices)
        fields = list(fields) if fields is not None else None
        replies = await asyncio.gather(*(self._call_current(u, idx, "get", idx, fields)
                                         for u, (_, idx) in shards.items()))
        parts = [(positions, buf) for (positions, _), buf in zip(shards.values(), replies)]
        return EncodedRows(len(indices), parts, fields_mask(fields))

    def statistics(self) -> QueueStats:
        return ray.get(self._controller.call.remote("statistics"))

    async def shutdown(self) -> None:
        """Kill the actors (only from the client that created them)."""
        for client in (self._rpc, *self._unit_rpc):
            client.close()
        if self._owner:
            for actor in (self._controller, *self.units):
                ray.kill(actor)
